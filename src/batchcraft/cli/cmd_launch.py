"""``batchcraft launch``: run any command under a saved parallel configuration."""

from __future__ import annotations

import argparse

NAME = "launch"
HELP = "run a command as pinned instances with a saved thread configuration"
DESCRIPTION = (
    "Start the configuration's number of instances of COMMAND, each pinned to its own cores, with "
    "OMP_NUM_THREADS / MKL_NUM_THREADS set before anything loads (and torch's thread settings for "
    "`python script.py` / `python -m module`). BATCHCRAFT_INSTANCE tells each instance its index. "
    "Ctrl-C or a failing instance stops all of them. Example: "
    "batchcraft launch --config best.json -- python serve.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="JSON from `batchcraft tune` or ParallelConfig.save")
    p.add_argument("--instances", type=int, default=None, help="override the number of instances")
    p.add_argument("--grace-s", type=float, default=5.0, help="seconds instances get to stop (default: 5)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more threads than usable cores (implied for a baseline setting that "
                        "`batchcraft tune` measured and chose, e.g. tensorflow-recommended)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def run(args) -> int:
    from batchcraft.parallel import ParallelConfig, launch

    cfg = ParallelConfig.load(args.config)
    if args.instances is not None:
        cfg.instances = args.instances
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    # the tuner measures baselines as specified, oversubscribed or not (search.py); run them so too
    oversubscribe = args.oversubscribe or cfg.label not in ("", "grid", "tuned")
    return launch(cfg, argv, grace_s=args.grace_s, oversubscribe=oversubscribe)
