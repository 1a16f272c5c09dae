"""First code an instance runs: die with the parent, pin, bind memory, set threads, then load torch.

Run as ``python [OPTIONS] -c <this file's text> SPEC_JSON [ARGS...]`` by
:mod:`batchcraft.parallel.processes` in a freshly exec'ed interpreter (never a fork of a process
that ran OpenMP: PyTorch #17199, #82219). It imports nothing from batchcraft and nothing heavy
before the affinity mask and the memory policy are set, so OpenMP / MKL size and place their
threads for this instance only (PyTorch #64864) and the first pages land on the instance's NUMA
node. The thread and knob environment (OMP_NUM_THREADS, LD_PRELOAD of an allocator,
OMP_WAIT_POLICY, ...) is already in ``os.environ`` from the launcher.

SPEC_JSON keys: mode ("worker" | "python-script" | "python-module" | "python-code" | "exec"),
parent (pid: ask for SIGTERM when it dies), cpus (list or null), membind (NUMA nodes or null),
intra_op_threads (int or null), inter_op_threads (int or null: torch.set_num_interop_threads),
matmul / conv (backends for a Python program: batchcraft.parallel.backends.install), fd (worker:
connection file descriptor), sys_path (worker: entries to prepend).
"""

import json
import os
import platform
import signal
import sys

_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "s390x": 237}
_MPOL_BIND = 2
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent):
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:  # the parent died before prctl: nothing would tell us
        os._exit(1)


def _membind(nodes):
    """set_mempolicy(MPOL_BIND, nodes): what `numactl --membind` does, without needing numactl."""
    import ctypes

    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        print(f"batchcraft: cannot bind memory to NUMA nodes {nodes} on {platform.machine()}", file=sys.stderr)
        return
    bits = 64
    words = max(nodes) // bits + 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _MPOL_BIND, mask, ctypes.c_ulong(words * bits + 1)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy(MPOL_BIND, nodes {nodes}) failed: {os.strerror(err)}")


def _main():
    spec = json.loads(sys.argv[1])
    rest = sys.argv[2:]
    _die_with_parent(spec.get("parent"))
    torch_preloaded = "torch" in sys.modules
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    if spec.get("membind"):
        _membind(spec["membind"])
    mode = spec["mode"]
    if mode == "exec":
        os.execvp(rest[0], rest)  # affinity, memory policy, death signal and environment survive exec
    if mode == "worker":
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
    if torch is not None and (spec.get("matmul", "default") != "default" or spec.get("conv", "default") != "default"):
        from batchcraft.parallel.backends import install

        install(matmul=spec.get("matmul", "default"), conv=spec.get("conv", "default"))
    import runpy

    if mode == "python-module":
        sys.argv = list(rest)
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif mode == "python-code":
        sys.argv = ["-c", *rest[1:]]
        sys.path[0] = ""
        main = sys.modules["__main__"]
        for name in [n for n in vars(main) if not n.startswith("__")]:
            delattr(main, name)  # the program starts with a clean __main__, as under `python -c`
        exec(compile(rest[0], "<string>", "exec"), vars(main))  # noqa: S102 - the user's own -c code
    else:
        sys.argv = list(rest)
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    _main()
