"""CUDA path of auto-batching; skipped cleanly where there is no GPU (CI never has one).

Run on a lent GPU by ``benchmarks/gpu_check.sh``. What it checks there: values and gradients
equal eager on CUDA (the TreeLSTM, every suite model under ``torch.set_default_device``, random
programs of the differential fuzzer), and that a steady inference call never makes the host wait
for the GPU (``torch.cuda.set_sync_debug_mode("error")``), so recording overlaps the kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from batchcraft import autobatch
from batchcraft.data import load_sentences
from batchcraft.models import suite
from batchcraft.models.treelstm import TreeLSTM
from equivalence import CORES, flat_tensors, random_tree

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

#: random programs per recording core (``BATCHCRAFT_GPU_FUZZ_EXAMPLES``); each one runs on the GPU
GPU_FUZZ_EXAMPLES = int(os.environ.get("BATCHCRAFT_GPU_FUZZ_EXAMPLES", "60"))


@pytest.fixture(autouse=True)
def _exact_cuda_math():
    # TF32 would make eager and batched results differ by its rounding (different shapes pick
    # different kernels); compare float32 against float32
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("core", CORES)
def test_treelstm_on_cuda_matches_eager_values_and_gradients(core):
    torch.manual_seed(0)
    m = TreeLSTM(vocab_size=60, hidden=32, word_dim=16, tag_dim=8).cuda()
    trees = [random_tree(n, seed=n) for n in (1, 4, 9, 16, 3, 7)]
    out = autobatch(m, core=core)(trees)
    ref = [m(t) for t in trees]
    for o, r in zip(out, ref):
        assert o.is_cuda
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    params = list(m.parameters())
    gb = torch.autograd.grad(sum(o.square().sum() for o in out), params)
    ge = torch.autograd.grad(sum(r.square().sum() for r in ref), params)
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("core", CORES)
def test_steady_inference_call_never_waits_for_the_gpu(core):
    """Index buffers and leaves are uploaded from pinned memory without a stream sync."""
    torch.manual_seed(0)
    m = TreeLSTM(vocab_size=60, hidden=32, word_dim=16, tag_dim=8).cuda()
    trees = [random_tree(n, seed=n) for n in (1, 4, 9, 16, 3, 7)]
    f = autobatch(m, core=core)
    with torch.no_grad():
        f(trees)  # first call: signatures inferred, blocks traced
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = f(trees)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = [m(t) for t in trees]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


SUITE = ["treelstm", "mvrnn", "birnn", "nestedrnn", "drnn", "berxit", "stackrnn"]


@pytest.mark.parametrize("name", SUITE)
def test_suite_model_under_default_device_cuda(name):
    """Models written without any device (``torch.tensor(w)``, ``torch.zeros(h)``), run on the GPU
    the way such code is: under ``torch.set_default_device("cuda")``."""
    sents = load_sentences(limit=12)
    with torch.device("cuda"):
        task = suite.build(name, sents, hidden=32)
        f = autobatch(task.fn)
        with torch.no_grad():
            out = f(task.instances)
            ref = [task.fn(x) for x in task.instances]
    assert f.stats.fallbacks == 0, f.stats.fallback_reasons
    for o, r in zip(out, ref):
        for a, b in zip(flat_tensors(o), flat_tensors(r)):
            assert a.device == b.device and a.is_cuda
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _fuzz(core):
    from fuzzing import instance_specs, programs
    from test_fuzz import check_program

    @settings(max_examples=GPU_FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(__import__("hypothesis").HealthCheck))
    @given(program=programs(), specs=st.lists(instance_specs, min_size=0, max_size=9),
           scheduler=st.sampled_from(("depth", "agenda")), fibers=st.booleans(), ragged=st.booleans(),
           hoist=st.booleans())
    def run(program, specs, scheduler, fibers, ragged, hoist):
        check_program(program, specs, scheduler=scheduler, fibers=fibers, cores=[core], ragged=ragged,
                      hoist=hoist, device="cuda")

    run()


@pytest.mark.parametrize("core", CORES)
def test_random_programs_match_eager_on_cuda(core):
    """The differential fuzzer's programs (values, gradients, buffers) with everything on the GPU."""
    _fuzz(core)
