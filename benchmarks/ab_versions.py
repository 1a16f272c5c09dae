"""A/B of two versions of batchcraft on the same models, in alternating fresh processes.

On a shared VM the speed of everything drifts by tens of percent within minutes (REFERENCES
§7; docs/benchmarks.md shows identical calls taking 0.4 to 1.25 s). Two versions timed one
after the other then differ by when they ran. Here each *round* runs one process of each
version (the order alternating between rounds), so drift hits both alike, and the ratio of the
two in one round is one paired observation; the report gives the median paired ratio and its
order-statistics interval (:mod:`batchcraft.measure.race`'s method).

The old version is checked out with ``git worktree`` into a temporary directory and its C core
built there; each process imports batchcraft from its version's ``src`` (``PYTHONPATH``).

Usage:
    python benchmarks/ab_versions.py --old REF [--new WORKTREE_OR_REF] [--models birnn:256,mvrnn:64]
                                     [--rounds 5] [--calls 5] [--threads 1] [--sentences 64]

Per process: build the suite model on the first ``--sentences`` UD EWT dev sentences, one
warm-up call of ``batchcraft.autobatch`` on all of them (one batch), then ``--calls`` timed
calls in inference; the process reports the median call (ms), or with ``--metric record`` the
median recording time (``stats.record_s``) per tree node / token (µs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, statistics, sys, time, torch
import batchcraft
from batchcraft.data import load_sentences
from batchcraft.models import suite
name, hidden, calls, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
metric = sys.argv[6] if len(sys.argv) > 6 else "call"
torch.set_num_threads(threads)
task = suite.build(name, load_sentences(limit=n), hidden=hidden)
fn = batchcraft.autobatch(task.fn)
with torch.no_grad():
    fn(task.instances)
    ts, rec = [], []
    for _ in range(calls):
        t0 = time.perf_counter(); fn(task.instances); ts.append(time.perf_counter() - t0)
        rec.append(fn.stats.record_s)
units = sum(len(x) if hasattr(x, "__len__") else 1 for x in task.instances)
value = statistics.median(ts) * 1e3 if metric == "call" else statistics.median(rec) * 1e6 / units
print(json.dumps({"ms": value, "file": batchcraft.__file__}))
"""


def _checkout(ref: str, tmp: str) -> Path:
    """A worktree of ``ref`` with its C core built; the path of its ``src``."""
    if Path(ref).is_dir():
        return Path(ref).resolve() / "src"
    wt = Path(tmp) / f"wt-{ref.replace('/', '_')}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(wt), ref],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=wt, check=True, capture_output=True)
    return wt / "src"


def _one(src: Path, model: str, hidden: int, args) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", WORKER, model, str(hidden), str(args.calls), str(args.threads),
                          str(args.sentences), args.metric], env=env, check=True, capture_output=True, text=True,
                         cwd=ROOT)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["file"].startswith(str(src)):
        raise SystemExit(f"ab_versions: the worker imported {res['file']}, not the version under {src}")
    return res["ms"]


def main(argv=None) -> int:
    from batchcraft.measure.race import median_interval

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="git ref (or a checkout directory) of the old version")
    ap.add_argument("--new", default=str(ROOT), help="checkout directory or git ref of the new one (default: this one)")
    ap.add_argument("--models", default="birnn:256,birnn:512,mvrnn:64,treelstm:256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--metric", choices=("call", "record"), default="call",
                    help="call: ms a call; record: host µs of recording per unit (tree node / token: "
                         "stats.record_s over the instances' lengths)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchcraft-ab-") as tmp:
        old, new = _checkout(args.old, tmp), _checkout(args.new, tmp)
        try:
            print(f"old: {old}\nnew: {new}\n{args.threads} thread(s), {args.sentences} sentences in one batch, "
                  f"median of {args.calls} calls per process, {args.rounds} rounds")
            unit = "ms" if args.metric == "call" else "record µs/node"
            print(f"| model | hidden | old {unit} (median of rounds) | new {unit} | new faster by [interval] coverage |")
            print("|---|---|---|---|---|")
            for spec in args.models.split(","):
                model, hidden = spec.split(":")
                pairs = []
                for r in range(args.rounds):
                    order = [(0, old), (1, new)] if r % 2 == 0 else [(1, new), (0, old)]
                    got = {k: _one(src, model, int(hidden), args) for k, src in order}
                    pairs.append((got[0], got[1]))
                ratios = [o / n for o, n in pairs]
                est = statistics.median(ratios)
                lo, hi, cov = median_interval(ratios)
                print(f"| {model} | {hidden} | {statistics.median(p[0] for p in pairs):.1f} | "
                      f"{statistics.median(p[1] for p in pairs):.1f} | {est:.2f} [{lo:.2f}, {hi:.2f}] {cov:.0%} |",
                      flush=True)
        finally:
            for src in (old, new):
                wt = src.parent
                if str(wt).startswith(tmp):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)],
                                   capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
