"""First code an instance runs: pin, set threads, then load torch and the real work.

Run as ``python -c <this file's text> SPEC_JSON [ARGS...]`` by :mod:`batchcraft.parallel.launcher`
in a freshly exec'ed interpreter (never a fork of a process that ran OpenMP: PyTorch #17199,
#82219). It imports nothing from batchcraft and nothing heavy before the affinity mask is set,
so OpenMP / MKL size and place their threads for this instance only (PyTorch #64864). The thread
environment (OMP_NUM_THREADS, MKL_NUM_THREADS, ...) is already in ``os.environ`` from the launcher.

SPEC_JSON keys: mode ("worker" | "python-script" | "python-module" | "exec"), cpus (list or null),
intra_op_threads (int or null), inter_op_threads (int or null: torch.set_num_interop_threads),
fd (worker: connection file descriptor), sys_path (worker: entries to prepend).
"""

import json
import os
import sys


def _main():
    spec = json.loads(sys.argv[1])
    rest = sys.argv[2:]
    torch_preloaded = "torch" in sys.modules
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    mode = spec["mode"]
    if mode == "exec":
        os.execvp(rest[0], rest)  # affinity and environment survive exec
    if mode == "worker":
        import signal

        # Ctrl-C reaches the whole process group; the launcher shuts workers down itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch
    except ImportError:  # a Python program that does not use torch: nothing more to set
        torch = None
    if torch is not None:
        if spec.get("intra_op_threads"):
            torch.set_num_threads(int(spec["intra_op_threads"]))
        if spec.get("inter_op_threads") and torch.get_num_interop_threads() != int(spec["inter_op_threads"]):
            torch.set_num_interop_threads(int(spec["inter_op_threads"]))  # fresh process: allowed once
    if mode == "worker":
        sys.path[:0] = spec.get("sys_path", [])
        from batchcraft.parallel._worker import serve

        serve(spec, torch_preloaded=torch_preloaded)
        # Skip interpreter teardown (about 1 s with torch loaded): the parent waits for this exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    import runpy

    sys.argv = list(rest)
    if mode == "python-module":
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    _main()
