"""``batchcraft bench``: the auto-batching side-by-side benchmark (DyNet, eager, hand-batched, batchcraft).

A front for ``benchmarks/vs_dynet.py`` of a source checkout: the benchmark, its DyNet
models and its worker processes live there, not in the installed package (DyNet is an
optional, separately built dependency that nothing in the package imports).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

NAME = "bench"
HELP = "auto-batching benchmark: DyNet vs. eager vs. hand-batched vs. batchcraft (needs a checkout)"
DESCRIPTION = (
    "Runs benchmarks/vs_dynet.py from the batchcraft source checkout: the suite models over UD "
    "English EWT sentences in DyNet (when installed; benchmarks/setup_dynet.sh), eager PyTorch, "
    "hand-batched PyTorch and batchcraft.autobatch, each in a fresh process; prints ms per batch, "
    "ratios, the FLOP-bound time and peak memory. With --write-docs it updates docs/benchmarks.md "
    "and docs/bench_vs_dynet.png."
)

SCRIPT = Path("benchmarks") / "vs_dynet.py"


def add_arguments(p) -> None:
    p.add_argument("--models", default=None, help="comma-separated suite models (default: treelstm,birnn,mvrnn)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 8,64)")
    p.add_argument("--sizes", default=None, help="comma-separated suite sizes, small/large (default both)")
    p.add_argument("--hidden", default=None, help="explicit hidden sizes (overrides --sizes)")
    p.add_argument("--sentences", type=int, default=None, help="UD sentences per pass (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes, median reported (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed passes first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default 1, as DyNet)")
    p.add_argument("--systems", default=None, help="subset of dynet,eager,handbatched,batchcraft")
    p.add_argument("--modes", default=None, help="inference,train (default both)")
    p.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md and the plot")
    p.add_argument("--json", action="store_true", help="print one JSON object (tables go to stderr)")
    p.add_argument("--checkout", default=None,
                   help="path of the batchcraft source checkout (default: the one this package runs from)")


def find_script(checkout: str | None = None) -> Path:
    """Path of benchmarks/vs_dynet.py in ``checkout`` (default: the checkout of this package).

    Raises:
        ConfigurationError: no such script (an installed package without its source checkout).
    """
    from batchcraft.errors import ConfigurationError

    root = Path(checkout) if checkout else Path(__file__).resolve().parents[3]  # src/batchcraft/cli/
    script = root / SCRIPT
    if not script.is_file():
        raise ConfigurationError(
            f"batchcraft bench: {script} not found; the benchmark ships with the source checkout, "
            "not with the installed package",
            hint="run it from a clone of the batchcraft repository (pip install -e .), or pass --checkout PATH")
    return script


def build_command(args, script: Path) -> list[str]:
    """The benchmark's command line for parsed ``args``."""
    from batchcraft.errors import ConfigurationError

    for name in ("sentences", "repeats", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigurationError(f"batchcraft bench: --{name} must be >= 1, got {v}")
    if args.warmup is not None and args.warmup < 0:
        raise ConfigurationError(f"batchcraft bench: --warmup must be >= 0, got {args.warmup}")
    cmd = [sys.executable, str(script)]
    for name in ("models", "batch_sizes", "sizes", "hidden", "sentences", "repeats", "warmup", "threads",
                 "systems", "modes"):
        v = getattr(args, name)
        if v is not None:
            cmd += [f"--{name.replace('_', '-')}", str(v)]
    for flag in ("write_docs", "json"):
        if getattr(args, flag):
            cmd.append(f"--{flag.replace('_', '-')}")
    return cmd


def run(args) -> int:
    from batchcraft.errors import ConfigurationError

    script = find_script(args.checkout)
    cmd = build_command(args, script)
    # The script prints its tables and progress on stderr and, with --json, one object on stdout:
    # both pass straight through.
    proc = subprocess.run(cmd, cwd=script.parent.parent)
    if proc.returncode == 2:
        raise ConfigurationError("batchcraft bench: the benchmark rejected its arguments (see above)")
    return proc.returncode
