"""``launch``: run any command once per instance under a saved configuration.

``batchcraft launch --config best.json -- python serve.py`` starts the configuration's instances
of the command through :mod:`batchcraft.parallel.processes`: each pinned to its own block of
cores (memory bound to its NUMA node on multi-node machines), with OMP_NUM_THREADS /
MKL_NUM_THREADS and every knob the configuration names (allocator through LD_PRELOAD, OpenMP
wait policy, matmul / conv backends) set before anything loads, and ``torch.set_num_threads`` /
``set_num_interop_threads`` before the program's first line for ``python script.py``,
``python -m module`` and ``python -c code`` (interpreter options such as ``-u`` or ``-X`` are
kept). Other commands are exec'ed after pinning and get the environment only
(:func:`batchcraft.parallel.apply_env` applies it from inside a Python program).

Stopping: Ctrl-C, SIGTERM and SIGHUP are forwarded to every instance's process group; after a
grace period what is left is killed. One failing instance stops the others. When all instances
have ended, whatever they left running in their groups is stopped the same way: nothing batchcraft
started outlives it.

Under torchrun (LOCAL_RANK and LOCAL_WORLD_SIZE set), the node's usable cores are split among the
local ranks (:func:`~batchcraft.parallel.config.rank_cpus`) and this rank runs one instance, pinned
within its share with the configuration's intra-op threads (fewer if its share is smaller), so
ranks never share cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.config import ParallelConfig, local_rank, rank_cpus, usable_cpus
from batchcraft.parallel.processes import StopSignals, bootstrap_code, exit_code_for, instance_env, instance_spec, \
    spawn, stop

__all__ = ["launch", "program_mode", "for_local_rank"]

_PYTHON = re.compile(r"python[0-9.]*(\.exe)?")
_PY_FLAGS = set("bBdEiIOqsSuvx")  # options without an argument (may be combined: -uB)
_PY_WITH_ARG = set("WX")  # options with one (attached or the next word)


def _split_python_options(args: list[str]) -> tuple[list[str], list[str]]:
    """(interpreter options, the rest: -c CODE / -m MODULE / SCRIPT and their arguments)."""
    opts, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("-c", "-m") or not a.startswith("-") or a == "-":
            break
        if a == "--":
            i += 1
            break
        letters = a[1:]
        if letters and letters[0] in _PY_WITH_ARG:
            if len(letters) == 1:
                opts += args[i:i + 2]
                i += 2
            else:
                opts.append(a)
                i += 1
            continue
        if letters.startswith("-") or not letters or not set(letters) <= _PY_FLAGS:
            break  # a long option (--version) or something we do not know: run the command as is
        opts.append(a)
        i += 1
    return opts, args[i:]


def program_mode(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(bootstrap mode, interpreter command with its options, arguments after the bootstrap spec).

    Raises:
        ConfigurationError: no command, a command not on the PATH, or a missing script.
    """
    if not argv:
        raise ConfigurationError("launch: no command given", hint="batchcraft launch --config best.json -- python script.py")
    exe = shutil.which(argv[0])
    if exe is None:
        raise ConfigurationError(f"launch: command not found: {argv[0]!r}", hint="check the PATH or give a full path")
    if _PYTHON.fullmatch(os.path.basename(argv[0])) and len(argv) >= 2:
        opts, rest = _split_python_options(argv[1:])
        if rest[:1] == ["-m"] and len(rest) >= 2:
            return "python-module", [exe, *opts], rest[1:]
        if rest[:1] == ["-c"] and len(rest) >= 2:
            return "python-code", [exe, *opts], rest[1:]
        if rest and not rest[0].startswith("-"):
            if not os.path.isfile(rest[0]):
                raise ConfigurationError(f"launch: no such script: {rest[0]!r} (working directory {os.getcwd()})")
            return "python-script", [exe, *opts], rest
    return "exec", [sys.executable], argv


def for_local_rank(config: ParallelConfig, cpus: list[int], rank: int, world: int) -> tuple[ParallelConfig, list[int], list[str]]:
    """(configuration, CPUs, notes) for local rank ``rank`` of ``world`` on ``cpus`` (torchrun).

    The rank gets its share of the cores (:func:`rank_cpus`) and one instance (a rank is one
    process of the distributed job) with the configuration's intra-op threads, capped to its share;
    an unpinned PyTorch-default configuration gets all of its share, pinned.
    """
    share = rank_cpus(cpus, rank, world)
    notes = []
    pools = config.inter_op_threads
    intra = config.intra_op_threads or max(1, len(share) // pools)
    if intra * pools > len(share):
        notes.append(f"local rank {rank}/{world} has {len(share)} core(s): intra-op threads {intra} -> "
                     f"{max(1, len(share) // pools)}")
        intra = max(1, len(share) // pools)
    if config.instances != 1:
        notes.append(f"local rank {rank}/{world}: one instance per rank (the configuration has {config.instances})")
    cfg = config.replace(instances=1, intra_op_threads=intra, pin=True)
    return cfg, share, notes


def launch(config: ParallelConfig, argv: list[str], *, cpus: list[int] | None = None,
           oversubscribe: bool = False, grace_s: float = 5.0, use_local_rank: bool = True) -> int:
    """Run ``argv`` once per instance of ``config``, pinned and with its thread settings and knobs.

    Each instance gets its block of cores (``os.sched_setaffinity`` before anything loads), its
    NUMA node's memory on multi-node machines, OMP_NUM_THREADS / MKL_NUM_THREADS, the knobs'
    environment, and BATCHCRAFT_INSTANCE (0-based), BATCHCRAFT_INSTANCES,
    BATCHCRAFT_INTRA_OP_THREADS, BATCHCRAFT_INTER_OP_THREADS, BATCHCRAFT_BATCH_SIZE to shard or
    size its work. For ``python script.py``, ``python -m module`` and ``python -c code`` the
    instance also gets ``torch.set_num_threads`` / ``set_num_interop_threads`` and the matmul /
    conv backends before the program runs. A configuration with ``compile`` needs the program's
    help: ``batchcraft.parallel.prepare(model)`` compiles when BATCHCRAFT_COMPILE is set (a
    warning says so).

    Args:
        config (ParallelConfig): the configuration (e.g. ``ParallelConfig.load("best.json")``).
        argv (list[str]): the command.
        cpus (list[int], optional): CPUs to spread instances over. Default: the usable CPUs.
        oversubscribe (bool): allow more threads than cores (a warning is still printed).
            Default: False.
        grace_s (float): seconds instances get to exit after a stop signal or a failure. Default: 5.
        use_local_rank (bool): under torchrun (LOCAL_RANK / LOCAL_WORLD_SIZE set), take this
            rank's share of the cores. Default: True.
    Returns:
        int: 0 if every instance exited 0; else the first failing instance's exit code; 128 + the
        signal number after Ctrl-C (130), SIGTERM (143) or SIGHUP (129). The other instances are
        stopped.
    Raises:
        ConfigurationError: bad configuration for these CPUs, empty or unknown command, missing
            script, an allocator that is not installed.
    """
    cpus = usable_cpus() if cpus is None else list(cpus)
    ranks = local_rank() if use_local_rank else None
    if ranks is not None:
        config, cpus, notes = for_local_rank(config, cpus, *ranks)
        for n in notes:
            print(f"batchcraft launch: {n}", file=sys.stderr)
    config.validate(cpus, oversubscribe=oversubscribe)
    mode, interpreter, rest = program_mode(list(argv))
    envs = [instance_env(config, i) for i in range(config.instances)]  # a missing allocator fails here
    why = config.oversubscription(cpus)
    if why is not None:
        print(f"batchcraft launch: warning: oversubscribed: {why}; the instances slow each other down "
              f"(pin them with intra-op threads that fit, e.g. a configuration from `batchcraft tune`)",
              file=sys.stderr)
    if config.compile:
        print("batchcraft launch: note: this configuration compiles the model: call "
              "batchcraft.parallel.prepare(model) in the program (it runs torch.compile when "
              "BATCHCRAFT_COMPILE=1)", file=sys.stderr)
    if mode == "exec" and (config.matmul != "default" or config.conv != "default"):
        print("batchcraft launch: note: not a `python ...` command: the matmul / conv backends are "
              "only in the environment; call batchcraft.parallel.apply_env() in the program",
              file=sys.stderr)
    code = bootstrap_code()
    procs = []
    with StopSignals() as signals:
        try:
            for i in range(config.instances):
                if signals.received is not None:
                    break
                spec = instance_spec(config, i, cpus, mode)
                procs.append(spawn([*interpreter, "-c", code, json.dumps(spec), *rest], envs[i]))
            while signals.received is None:
                codes = [p.poll() for p in procs]
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i, rc = failed[0]
                    print(f"batchcraft launch: instance {i} (pid {procs[i].pid}) exited with code {rc}; "
                          f"stopping the others", file=sys.stderr)
                    stop(procs, grace_s)
                    return rc
                if all(c == 0 for c in codes):
                    stop(procs, grace_s)  # what the instances left running in their groups
                    return 0
                time.sleep(0.05)
            sig = signals.received
            stop(procs, grace_s, first_signal=sig)
            return exit_code_for(sig)
        except BaseException:
            stop(procs, grace_s)
            raise
