"""The process's thread settings: set inter-op threads safely, restore intra-op threads.

``torch.set_num_threads`` can change at any time; ``torch.set_num_interop_threads`` only once per
process and only before inter-op work has started, and older PyTorch aborted the process when it
was called too late (nnUNet #1451, PyTorch PR #27947). So the value is checked first, and a trial
that needs another value runs in a fresh process (:mod:`batchcraft.parallel.launcher`).
"""

from __future__ import annotations

import contextlib
import os

import torch

from batchcraft.errors import ConfigurationError

__all__ = ["set_inter_op_threads", "preserved_thread_state", "apply_env", "prepare"]


def set_inter_op_threads(n: int) -> bool:
    """Make torch's inter-op pool ``n`` threads if it can still change; never abort the process.

    Returns:
        bool: True if the value was set now, False if it already was ``n`` (nothing to do).
    Raises:
        ConfigurationError: ``n`` < 1, or the pool already started / was set with another size;
            the hint says to use a fresh process.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigurationError(f"set_inter_op_threads: n must be an int >= 1, got {n!r}")
    current = torch.get_num_interop_threads()
    if current == n:
        return False
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError as exc:
        raise ConfigurationError(
            f"set_inter_op_threads: cannot change torch's inter-op threads from {current} to {n} in "
            f"this process: {exc}",
            hint="inter-op threads can be set once, before any parallel work; run the work in a "
            "fresh process (batchcraft launch, or WorkerGroup)") from None
    return True


@contextlib.contextmanager
def preserved_thread_state():
    """Restore ``torch.get_num_threads()`` and OMP_NUM_THREADS / MKL_NUM_THREADS on exit."""
    saved_threads = torch.get_num_threads()
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        yield
    finally:
        if torch.get_num_threads() != saved_threads:
            torch.set_num_threads(saved_threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def apply_env() -> dict:
    """Apply the settings ``batchcraft launch`` put in the environment; return them.

    For programs started by ``batchcraft launch`` that are not plain ``python script.py`` /
    ``-m`` / ``-c`` runs (those get the settings before they start): intra-op and inter-op
    threads, and the matmul / conv backends (:func:`batchcraft.parallel.backends.install`).
    Call it first thing.

    Returns:
        dict: instance, instances, intra_op_threads, inter_op_threads, batch_size (None if
        unset), matmul, conv, compile.
    Raises:
        ConfigurationError: inter-op threads can no longer be changed in this process, or an
            unknown backend.
    """
    def _int(name):
        v = os.environ.get(name, "")
        return int(v) if v.strip() else None

    settings = {
        "instance": _int("BATCHCRAFT_INSTANCE"),
        "instances": _int("BATCHCRAFT_INSTANCES"),
        "intra_op_threads": _int("BATCHCRAFT_INTRA_OP_THREADS"),
        "inter_op_threads": _int("BATCHCRAFT_INTER_OP_THREADS"),
        "batch_size": _int("BATCHCRAFT_BATCH_SIZE"),
        "matmul": os.environ.get("BATCHCRAFT_MATMUL") or "default",
        "conv": os.environ.get("BATCHCRAFT_CONV") or "default",
        "compile": bool(os.environ.get("BATCHCRAFT_COMPILE")),
    }
    if settings["intra_op_threads"]:
        torch.set_num_threads(settings["intra_op_threads"])
        if settings["inter_op_threads"]:
            set_inter_op_threads(settings["inter_op_threads"])
    if settings["matmul"] != "default" or settings["conv"] != "default":
        from batchcraft.parallel.backends import install

        install(matmul=settings["matmul"], conv=settings["conv"])
    return settings


def prepare(model):
    """The model as the configuration ``batchcraft launch`` started this program with wants it.

    ``torch.compile(model)`` when the configuration names ``compile`` (BATCHCRAFT_COMPILE=1), else
    the model itself; the backends are already installed for the whole process by the launcher.
    Returns the model unchanged outside ``batchcraft launch``.
    """
    if os.environ.get("BATCHCRAFT_COMPILE"):
        return torch.compile(model)
    return model
