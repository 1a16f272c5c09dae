"""``batchcraft launch``: run any command under a saved parallel configuration."""

from __future__ import annotations

import argparse

NAME = "launch"
HELP = "run a command as pinned instances with a saved thread / knob configuration"
DESCRIPTION = (
    "Start the configuration's number of instances of COMMAND, each pinned to its own cores (memory "
    "bound to its NUMA node on multi-node machines), with OMP_NUM_THREADS / MKL_NUM_THREADS and the "
    "configuration's knobs (allocator, OpenMP wait policy, matmul / conv backends) set before anything "
    "loads, and torch's thread settings for `python script.py`, `python -m module` and `python -c code`. "
    "BATCHCRAFT_INSTANCE tells each instance its index. Ctrl-C, SIGTERM, SIGHUP or a failing instance "
    "stops all of them, each with everything it started. Under torchrun (LOCAL_RANK / LOCAL_WORLD_SIZE) "
    "the node's cores are split among the local ranks. Example: "
    "batchcraft launch --config best.json -- python serve.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="JSON from `batchcraft tune` or ParallelConfig.save")
    p.add_argument("--instances", type=int, default=None, help="override the number of instances")
    p.add_argument("--grace-s", type=float, default=5.0, help="seconds instances get to stop (default: 5)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more threads than usable cores (implied for a baseline setting that "
                        "`batchcraft tune` measured and chose, e.g. tensorflow-recommended); a warning is printed")
    p.add_argument("--ignore-local-rank", action="store_true",
                   help="under torchrun, do not split the cores among the local ranks")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def run(args) -> int:
    from batchcraft.parallel import ParallelConfig, launch

    cfg = ParallelConfig.load(args.config)
    if args.instances is not None:
        cfg.instances = args.instances
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    # the tuner measures baselines as specified, oversubscribed or not (grid.py); run them so too
    oversubscribe = args.oversubscribe or cfg.label not in ("", "grid", "tuned")
    return launch(cfg, argv, grace_s=args.grace_s, oversubscribe=oversubscribe,
                  use_local_rank=not args.ignore_local_rank)
