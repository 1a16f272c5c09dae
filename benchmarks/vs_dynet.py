"""Auto-batching side by side: DyNet vs. eager PyTorch vs. hand-batched vs. batchcraft (issue 7).

Usage:
    python benchmarks/vs_dynet.py [--models treelstm,birnn,mvrnn] [--batch-sizes 8,64] [--sizes small,large]
                                  [--sentences 64] [--repeats 5] [--warmup 1] [--threads 1]
                                  [--systems all] [--json] [--write-docs]
    batchcraft bench [same options]

Same models (same formulation, same parameters copied from the torch model), same real
inputs (the first ``--sentences`` UD English EWT dev sentences, in file order, cut into
batches), same sizes, every system in a fresh process (vs_dynet_worker.py). Per system and
mode: ms per batch = median over ``--repeats`` timed passes over all batches (after
``--warmup`` passes). Inference = forward of every output; training step = forward, loss =
sum of all outputs, backward (gradients only, no optimizer). Outputs and one weight's
gradient are compared with eager PyTorch. The limit column is the FLOP-bound time: model
FLOPs counted per node (:mod:`_flops`) over the fp32 GEMM rate measured here.
DyNet is optional: without it (benchmarks/setup_dynet.sh installs it) its columns are empty.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _flops  # noqa: E402
import _vs_dynet_report as report  # noqa: E402
from _report import save_json, write_section  # noqa: E402
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.measure import machine_info  # noqa: E402
from batchcraft.models import suite  # noqa: E402

DYNET_MODES = (0, 1, 2, 3)  # off, agenda, depth, agenda with per-depth counts (dynet/exec.cc)
SCHEDULERS = ("depth", "agenda")


def dynet_available() -> bool:
    """True when the ``dynet`` package can be imported (checked without importing it here)."""
    return importlib.util.find_spec("dynet") is not None and importlib.util.find_spec("dynet_config") is not None


def handbatched_available(model: str) -> bool:
    """True when a hand-batched PyTorch reference exists for ``model`` (see _handbatched.py)."""
    import _handbatched

    return _handbatched.available(model)


def load_avg() -> list[float]:
    """1, 5 and 15 minute load averages (``uptime``), for the record beside the numbers."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def systems_for(model: str, want: list[str]) -> tuple[list[str], list[str]]:
    """(systems to run, notes on the ones left out) for ``model``."""
    import dynet_models

    out, notes = [], []
    if "dynet" in want:
        if not dynet_available():
            notes.append("DyNet is not installed (benchmarks/setup_dynet.sh installs it): DyNet columns empty")
        elif model not in dynet_models.MODELS:
            notes.append(f"no DyNet version of {model} in benchmarks/dynet_models.py")
        else:
            out += [f"dynet-{m}" for m in DYNET_MODES]
    if "eager" in want:
        out.append("eager")
    if "handbatched" in want:
        if handbatched_available(model):
            out.append("handbatched")
        else:
            notes.append(f"no hand-batched PyTorch reference for {model} (batchcraft.models.handbatched)")
    if "batchcraft" in want:
        out += [f"batchcraft-{s}" for s in SCHEDULERS]
    if "nodedup" in want:  # ablation: the depth scheduler without per-flush deduplication
        out.append("batchcraft-depth-nodedup")
    return out, notes


def to_dynet_instance(model: str, inst, task) -> dict:
    """The plain-data form of one instance that benchmarks/dynet_models.py reads."""
    if model in ("treelstm", "mvrnn", "birnn"):
        return {"children": inst.children, "root": inst.root, "word_ids": inst.word_ids,
                "upos_ids": inst.upos_ids}
    if model == "nestedrnn":
        ids = task.model.char_ids
        return {"char_ids": [[ids.get(ch, 0) for ch in w] for w in inst.words]}
    raise KeyError(f"vs_dynet: no DyNet instance conversion for {model!r}")


def prepare(model: str, hidden: int, n_sentences: int, work: Path) -> dict:
    """Build the torch model once, export its parameters (.npz) and the DyNet instances (.json)."""
    task = suite.build(model, load_sentences(limit=n_sentences), hidden=hidden)
    params = work / f"{model}-h{hidden}.npz"
    np.savez(params, **{k: v.detach().numpy() for k, v in task.model.state_dict().items()})
    inst = work / f"{model}-instances.json"
    if not inst.exists() and model in _dynet_model_names():
        inst.write_text(json.dumps([to_dynet_instance(model, x, task) for x in task.instances]))
    return {"task": task, "params_npz": str(params), "dynet_instances_json": str(inst)}


def _dynet_model_names():
    import dynet_models

    return set(dynet_models.MODELS)


def run_worker(spec: dict, work: Path, timeout_s: float) -> list[dict]:
    """Run one system in a fresh process; its results per batch size, or ``[{"error": ...}]``."""
    name = f"{spec['system']}-{spec['model']}-h{spec['hidden']}"
    sp, op = work / f"{name}.spec.json", work / f"{name}.out.json"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    try:
        p = subprocess.run([sys.executable, str(HERE / "vs_dynet_worker.py"), str(sp), str(op)],
                           capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return [{**_key(spec), "error": f"timed out after {timeout_s:.0f} s"}]
    if p.returncode != 0 or not op.exists():
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return [{**_key(spec), "error": f"exit {p.returncode}: {' | '.join(tail)}"}]
    return json.loads(op.read_text())


def run_worker_with_memory(spec: dict, work: Path, timeout_s: float, max_mem_mb: int = 4096) -> list[dict]:
    """:func:`run_worker`; a DyNet auto-batching run that fails for memory is rerun with twice the pools.

    DyNet 2.1.2 refuses to grow its memory pools while auto-batching ("please pre-allocate enough
    memory using --dynet-mem"), so those runs need their pools sized up front.
    """
    while True:
        res = run_worker(spec, work, timeout_s)
        err = res[0].get("error", "")
        if not (spec["system"] != "dynet-0" and spec["system"].startswith("dynet-")
                and ("pre-allocate" in err or "out of memory" in err.lower()) and spec["dynet_mem_mb"] < max_mem_mb):
            return res
        spec = {**spec, "dynet_mem_mb": 2 * spec["dynet_mem_mb"]}


def _hidden_sizes(model: str, args) -> list[int]:
    if args.hidden:
        return [int(h) for h in args.hidden.split(",")]
    sizes = getattr(suite, "MODEL_SIZES", {}).get(model, suite.SIZES)
    return [sizes[s] for s in args.sizes.split(",")]


def _key(spec):
    return {**{k: spec[k] for k in ("system", "model", "hidden")}, "batch_size": max(spec["batch_sizes"])}


def cross_check(results: list[dict], work: Path) -> None:
    """Add ``out_max_abs_diff`` and ``grad_max_abs_diff`` vs. eager to each result, in place."""
    for r in results:
        if "error" in r:
            continue
        ref = f"eager-{r['model']}-h{r['hidden']}-b{r['batch_size']}"
        me = f"{r['system']}-{r['model']}-h{r['hidden']}-b{r['batch_size']}"
        for kind in ("out", "grad"):
            a, b = work / f"{me}-{kind}.npy", work / f"{ref}-{kind}.npy"
            if a.exists() and b.exists():
                r[f"{kind}_max_abs_diff"] = float(np.abs(np.load(a) - np.load(b)).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="treelstm,birnn,mvrnn")
    ap.add_argument("--batch-sizes", default="8,64")
    ap.add_argument("--sizes", default="small,large",
                    help="suite sizes: hidden 256/512 (MV-RNN 64/128, ACRoBat's sizes)")
    ap.add_argument("--hidden", default=None, help="explicit hidden sizes for every model (overrides --sizes)")
    ap.add_argument("--sentences", type=int, default=64, help="UD EWT dev sentences per pass (default 64)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads of the timed systems (default 1, as DyNet's CPU backend)")
    ap.add_argument("--gemm-threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for the GEMM rate behind the FLOP bound (default: all usable CPUs)")
    ap.add_argument("--systems", default="dynet,eager,handbatched,batchcraft",
                    help="comma list of dynet, eager, handbatched, batchcraft, nodedup (batchcraft's depth "
                         "scheduler without per-flush deduplication, an ablation column)")
    ap.add_argument("--modes", default="inference,train")
    ap.add_argument("--dynet-mem", type=int, default=64,
                    help="DyNet without auto-batching: initial memory pools, MB, grown on demand (DyNet's "
                         "default, 512, is allocated and touched at start, hiding what a model needs). Default 64")
    ap.add_argument("--dynet-autobatch-mem", type=int, default=128,
                    help="DyNet with auto-batching: pools, MB (it cannot grow them then); doubled up to 4096 "
                         "while a run fails for memory, so the peak shows roughly what a model needs. Default 128")
    ap.add_argument("--worker-timeout", type=float, default=600.0, help="seconds per worker process")
    ap.add_argument("--plot", default=str(HERE.parent / "docs" / "bench_vs_dynet.png"))
    ap.add_argument("--docs-marker", default="vs_dynet", help="section marker in docs/benchmarks.md")
    ap.add_argument("--json", action="store_true", help="stdout: one JSON object; tables to stderr")
    ap.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md and the plot")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.sentences < 1:
        ap.error("--repeats must be >= 1, --warmup >= 0, --sentences >= 1")
    log = sys.stderr
    models = args.models.split(",")
    for m in models:
        if m not in suite.BUILDERS:
            ap.error(f"unknown model {m!r}; known: {', '.join(sorted(suite.BUILDERS))}")
    hiddens = {m: _hidden_sizes(m, args) for m in models}
    bsizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    t_start, load_before = time.time(), load_avg()
    gemm = _flops.measure_gemm_rate(sorted({h for hs in hiddens.values() for h in hs}), threads=args.gemm_threads)
    print(f"fp32 GEMM rate: {gemm['rate_flop_per_s'] / 1e9:.1f} GFLOP/s ({gemm['best_shape']})", file=log)
    results, notes, flops = [], [], {}
    with tempfile.TemporaryDirectory(prefix="vs_dynet-") as tmp:
        work = Path(tmp)
        for model in models:
            systems, why = systems_for(model, args.systems.split(","))
            notes += why
            for hidden in hiddens[model]:
                prep = prepare(model, hidden, args.sentences, work)
                for bs in bsizes:
                    flops[(model, hidden, bs)] = _flops.per_batch(model, prep["task"], bs)
                for system in systems:
                    spec = {"system": system, "model": model, "hidden": hidden, "batch_sizes": bsizes,
                            "sentences": args.sentences, "warmup": args.warmup, "repeats": args.repeats,
                            "modes": modes, "threads": args.threads, "dump_dir": str(work),
                            "grad_param": _flops.GRAD_PARAM[model], "params_npz": prep["params_npz"],
                            "dynet_instances_json": prep["dynet_instances_json"],
                            "dynet_mem_mb": args.dynet_mem if system == "dynet-0" else args.dynet_autobatch_mem}
                    for r in run_worker_with_memory(spec, work, args.worker_timeout):
                        results.append(r)
                        msg = r.get("error") or " ".join(f"{m} {r[m + '_ms']:.1f} ms" for m in modes)
                        print(f"[{time.time() - t_start:5.0f}s] {model} h{hidden} b{r['batch_size']} "
                              f"{system}: {msg}", file=log)
        cross_check(results, work)
    notes = list(dict.fromkeys(notes))
    # The CPU is shared: measure the GEMM rate again at the end and keep the faster measurement.
    again = _flops.measure_gemm_rate(sorted({h for hs in hiddens.values() for h in hs}), threads=args.gemm_threads)
    if again["rate_flop_per_s"] > gemm["rate_flop_per_s"]:
        gemm = again
    print(f"fp32 GEMM rate used: {gemm['rate_flop_per_s'] / 1e9:.1f} GFLOP/s ({gemm['best_shape']})", file=log)
    payload = {"machine": machine_info(), "load_avg_before": load_before, "load_avg_after": load_avg(),
               "command": "python benchmarks/vs_dynet.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "args": vars(args), "gemm": gemm, "notes": notes, "results": results,
               "flops": [{"model": k[0], "hidden": k[1], "batch_size": k[2], **v} for k, v in flops.items()],
               "wall_s": time.time() - t_start}
    payload["rows"] = report.rows(payload)
    print(report.text_tables(payload), file=log if args.json else sys.stdout)
    save_json("vs_dynet", payload)
    if args.write_docs:
        report.plot(payload, args.plot)
        write_section(args.docs_marker, report.markdown(payload, Path(args.plot)))
        print(f"wrote docs/benchmarks.md section {args.docs_marker} and {args.plot}", file=log)
    if args.json:
        print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
