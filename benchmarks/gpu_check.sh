#!/usr/bin/env bash
# Everything GPU-specific, in one run on a lent CUDA machine (issues 13 and 14 item 9):
#   1. installs what the machine lacks from wheels carried in .whl/ (greenlet, conllu,
#      nvidia-cudnn-frontend; the machine's own torch is used) and builds the C core in place;
#   2. runs the GPU tests (auto-batching on CUDA: values, gradients, no host waits, the suite under
#      a default CUDA device, the differential fuzzer on CUDA; cuDNN frontend plans vs PyTorch);
#   3. benchmarks/gpu_autobatch.py: the suite, eager vs batchcraft vs hand-batched;
#   4. benchmarks/gpu_microbatch.py: cuDNN plans under workspace budgets vs cudnn.benchmark.
# Each step has its own time limit and writes its log/JSON under $OUT (default ./gpu-out; the logs end
# up in $OUT/logs.tgz); a failing step does not stop the next. Fetch the wheels first (README of the device tool):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl greenlet==3.5.6 conllu==6.0.0 nvidia-cudnn-frontend==1.32.0
# Usage: OUT=/some/dir bash benchmarks/gpu_check.sh [fuzz examples per core (60)]
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
FUZZ=${1:-40}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record rc and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
  tail -n 5 "$OUT/$name.log"
}

if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/install.log" 2>&1 || echo "wheel install failed (see install.log)"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-}
step build 90 $PY setup.py build_ext --inplace
{
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print(torch.cuda.get_device_properties(0))"
  $PY -c "from batchcraft.autobatching import _native; print('C core:', _native.available, _native.reason)"
  nproc; grep -m1 'model name' /proc/cpuinfo
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

BATCHCRAFT_GPU_FUZZ_EXAMPLES=$FUZZ step tests_gpu 180 $PY -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/autobatching/test_gpu.py tests/microbatching/test_cuda.py
step tests_device 60 $PY -m pytest -q -p no:cacheprovider tests/autobatching/test_default_device.py
step gpu_autobatch 170 $PY benchmarks/gpu_autobatch.py --sentences 128 --sizes small,large \
  --time-limit-s 110 --out "$OUT/gpu_autobatch.json"
step gpu_microbatch 110 $PY benchmarks/gpu_microbatch.py --models alexnet,resnet18 --batch-size 128 \
  --image-size 224 --time-limit-s 50 --out "$OUT/gpu_microbatch.json"
echo "total ${SECONDS}s" | tee -a "$OUT/steps.txt"
# the logs as one file (a lent machine returns at most 8 files)
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
