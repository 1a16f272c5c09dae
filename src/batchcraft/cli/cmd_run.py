"""``batchcraft run MODEL``: the main job: a model over real UD trees, eager vs. auto-batched."""

from __future__ import annotations

import json
import os
import sys

from batchcraft.measure.machine import busy_cpus as _busy_cpus

NAME = "run"
#: --profile: auto-batched passes after the timed one, back to back, for the steady time split
PROFILE_PASSES = 5
HELP = "run a suite model over real UD EWT data: eager per instance vs. batchcraft.autobatch"
DESCRIPTION = (
    "Runs a per-instance dynamic model over UD English EWT sentences (embedded dev split by "
    "default), once eagerly one instance at a time and once through batchcraft.autobatch, and "
    "prints time per batch, instances/s, speed-up, batched calls vs. operations recorded and the "
    "largest difference between the two results."
)


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="model name (see --list)")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--batch-size", type=int, default=64, help="instances per batch (default 64)")
    p.add_argument("--size", choices=["small", "large"], default="small",
                   help="model size: small = hidden 256, large = 512 (MV-RNN: 64 / 128); default small")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (overrides --size)")
    p.add_argument("--data", default=None, help="a .conllu file (default: embedded UD EWT dev)")
    p.add_argument("--limit", type=int, default=512, help="sentences to use (default 512)")
    p.add_argument("--scheduler", choices=["depth", "agenda"], default="depth")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="also print the time split of the runtime")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args) -> None:
    from batchcraft.errors import ConfigurationError

    if args.batch_size < 1:
        raise ConfigurationError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        raise ConfigurationError(f"--limit must be >= 1, got {args.limit}")
    if args.hidden is not None and args.hidden < 1:
        raise ConfigurationError(f"--hidden must be >= 1, got {args.hidden}")
    if args.threads is not None and args.threads < 1:
        raise ConfigurationError(f"--threads must be >= 1, got {args.threads}")
    if args.threads:
        from batchcraft.parallel.config import usable_cpus

        cpus = len(usable_cpus())
        if args.threads > cpus:  # (allowed: the timings then show what oversubscription costs)
            print(f"batchcraft run: note: --threads {args.threads} on {cpus} usable core{'s' * (cpus != 1)}: "
                  f"the threads share cores, so the times include oversubscription", file=sys.stderr)


def run(args) -> int:
    from batchcraft.models import suite

    if args.list:
        for name, (_, desc) in sorted(suite.BUILDERS.items()):
            print(f"{name:12s} {desc}")
        return 0
    if not args.model:
        print("batchcraft run: name a model (batchcraft run --list)", file=sys.stderr)
        return 2
    if args.model not in suite.BUILDERS:
        from batchcraft.errors import ConfigurationError

        raise ConfigurationError(f"unknown model {args.model!r}",
                                 hint=f"choose one of: {', '.join(sorted(suite.BUILDERS))}")
    _check(args)
    import torch

    from batchcraft.data import load_sentences
    from batchcraft.measure import format_table, machine_info
    from batchcraft.measure.compare import compare_eager

    if args.threads:
        torch.set_num_threads(args.threads)
    sentences = load_sentences(args.data, limit=args.limit)
    if not sentences:
        from batchcraft.errors import DataFormatError

        raise DataFormatError(args.data or "the embedded UD data", None, "no sentences to run",
                              hint="give a CoNLL-U file with at least one sentence")
    task = suite.build(args.model, sentences, size=args.size, hidden=args.hidden)
    load = _busy_cpus()  # CPUs other processes kept busy just before the run
    res = compare_eager(task.fn, task.instances, batch_size=args.batch_size, scheduler=args.scheduler,
                        progress=not (args.no_progress or args.json), split_passes=PROFILE_PASSES if args.profile else 0)
    res = {"model": args.model, "size": args.size, "hidden": task.hidden, **res,
           "machine": machine_info(), "busy_cpus_before": load}
    if args.json:
        print(json.dumps(res))
        return 0
    m = res["machine"]
    print(f"{task.description}; {res['instances']} sentences in {res['batches']} batches of "
          f"{args.batch_size}; {m['cpu']}, {m['torch_threads']} thread{'' if m['torch_threads'] == 1 else 's'}, "
          f"torch {m['torch']}")
    rows = [
        ["eager (one instance at a time)", res["eager_ms"], res["instances_per_s_eager"], 1.0, "-", "-"],
        [f"batchcraft.autobatch ({args.scheduler})", res["batchcraft_ms"],
         res["instances_per_s_batchcraft"], res["speedup"],
         f"{res['batched_calls']:.1f} / {res['ops_recorded']:.0f}", f"{res['max_abs_diff']:.1e}"],
    ]
    print(format_table(["", "ms/batch", "instances/s", "speed-up vs eager", "batched calls / ops per batch",
                        "max |out - eager|"], rows))
    print("(ms/batch: median over every batch, after one untimed warm-up call of each system on the first; batched calls / ops: means per batch)")
    if load >= 0.5:
        print(f"note: other processes kept {load:.1f} of {os.cpu_count() or 1} CPUs busy as this run began: "
              f"timings (the eager loop's with several threads most) are unreliable; rerun on a quiet machine"
              + (" or with --threads 1" if torch.get_num_threads() > 1 else ""))
    if args.profile:
        print(f"auto-batched time split per batch: record {res['record_ms']:.1f} ms, schedule "
              f"{res['schedule_ms']:.1f} ms, gather {res['gather_ms']:.1f} ms, batched calls "
              f"{res['kernel_ms']:.1f} ms; {res['record_ms'] * 1e3 / max(res['ops_recorded'], 1):.1f} "
              f"host µs per recorded op; fallbacks {res['fallbacks']}, mean "
              f"{res['mean_batch']:.1f} instances' ops per batched call; {res['steps_fused']:.0f} elementwise "
              f"steps in {res['fused_kernels']:.0f} fused kernels per batch")
        print(f"recording: {res['steady_record_us_per_unit']:.1f} host µs per tree node / token "
              f"({res['work_units']:.0f} per batch; per batch the median of {res['split_passes']} more auto-batched "
              f"passes run back to back, {res['steady_record_ms']:.1f} ms a batch; the timed pass, each call right "
              f"after the batch's eager loop: {res['record_us_per_unit']:.1f} µs); first call {res.get('first_call_ms', 0):.0f} ms = "
              f"{res.get('first_call_ratio', 0):.1f}x the same batch's first timed call "
              f"({res.get('first_batch_ms', 0):.1f} ms; signatures inferred, "
              f"blocks traced; kernel choices are measured once per machine and cached)")
    return 0
