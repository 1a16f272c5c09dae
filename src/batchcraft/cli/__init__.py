"""Command-line interface: ``batchcraft <subcommand>``.

Each subcommand lives in its own module ``batchcraft.cli.cmd_<name>`` that
defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are discovered, so adding a subcommand touches no other file.
Exit codes: 0 ok, 1 error, 2 usage. With ``--json``, stdout holds one object
(``{"error": {...}}`` on failure); progress and tables for humans go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys

from batchcraft.errors import BatchcraftError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _commands():
    import batchcraft.cli as pkg

    mods = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("cmd_"):
            mods.append(importlib.import_module(f"batchcraft.cli.{info.name}"))
    return sorted(mods, key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchcraft",
        description="Make PyTorch work fast by choosing its grain: merge (auto-batching), "
        "split (micro-batching), spread (parallelism tuning).",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for mod in _commands():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except BatchcraftError as exc:
        if args.debug:
            raise
        if getattr(args, "json", False):
            print(json.dumps({"error": exc.to_dict()}))
        print(f"batchcraft {args.subcommand}: error [{exc.code}]: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
