"""Training throughput of auto-batched models: 1 process vs 2 DDP processes (gloo, this CPU).

Runs examples/train_ddp.py in fresh processes (torchrun for 2 ranks), the same global step (a
fixed number of words per step, split by work over the ranks), in interleaved repeats; reports
the median words/s and its ratio to one process with one thread. Also measures the two ways of
handling parameters an early-exit model leaves unused (find_unused_parameters vs a zero term).

    flock /tmp/batchcraft-cpu.lock python benchmarks/ddp_training.py [--repeats 3] [--write-doc]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import ROOT, save_json, write_section  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_ddp.py")
# (label, model, processes, threads per process, extra flags)
CONFIGS = [
    ("TreeLSTM, 1 process x 1 thread", "treelstm", 1, 1, []),
    ("TreeLSTM, 1 process x 2 threads", "treelstm", 1, 2, []),
    ("TreeLSTM, 2 processes x 1 thread (DDP)", "treelstm", 2, 1, []),
    ("TreeLSTM, 2 processes, find_unused_parameters", "treelstm", 2, 1, ["--find-unused"]),
    ("Berxit, 1 process x 1 thread, find_unused_parameters", "berxit", 1, 1, ["--find-unused"]),
    ("Berxit, 2 processes, find_unused_parameters", "berxit", 2, 1, ["--find-unused"]),
    ("Berxit, 2 processes, zero term", "berxit", 2, 1, ["--zero-term"]),
]


def run(model, procs, threads, extra, args) -> dict:
    py = [EXAMPLE, "--model", model, "--steps", str(args.steps), "--sentences", str(args.sentences),
          "--hidden", str(args.hidden), "--step-work", str(args.step_work), *extra]
    if procs == 1:
        cmd = [sys.executable, *py]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *py]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--sentences", type=int, default=600)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--step-work", type=float, default=800)
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args(argv)
    from batchcraft.measure.machine import machine_info

    t0 = time.perf_counter()
    samples = {c[0]: [] for c in CONFIGS}
    for rep in range(args.repeats):  # interleaved: load bursts hit every configuration alike
        for label, model, procs, threads, extra in CONFIGS:
            r = run(model, procs, threads, extra, args)
            samples[label].append(r["words_per_s"])
            print(f"[{rep}] {label}: {r['words_per_s']:.0f} words/s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = {"treelstm": med[CONFIGS[0][0]], "berxit": med[CONFIGS[4][0]]}
    lines = ["| configuration | words/s (median) | runs | vs 1 process x 1 thread |", "|---|---:|---|---:|"]
    for label, model, *_ in CONFIGS:
        runs = ", ".join(f"{v:.0f}" for v in samples[label])
        lines.append(f"| {label} | {med[label]:.0f} | {runs} | {med[label] / base[model]:.2f}x |")
    info = machine_info()
    text = ("\n".join(lines) + f"\n\nTraining steps of {args.step_work:g} words (global, split by work over the "
            f"ranks), {args.steps} timed steps after a warm-up pass, hidden {args.hidden}, the first "
            f"{args.sentences} UD EWT dev sentences, Adam; {info['cpu']}, {info['usable_cpus']} usable cores, "
            f"torch {info['torch']}, gloo; median of {args.repeats} interleaved repeats, each a fresh process "
            f"group. Command: `flock /tmp/batchcraft-cpu.lock python benchmarks/ddp_training.py "
            f"--repeats {args.repeats}`; {time.perf_counter() - t0:.0f} s.")
    print(text)
    save_json("ddp_training", {"samples": samples, "median": med, "machine": info, "args": vars(args)})
    if args.write_doc:
        write_section("ddp-training", text, ROOT / "docs" / "scale-out.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
