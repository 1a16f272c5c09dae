"""The default device of factory calls in instance code (``torch.set_default_device``).

``torch.set_default_device("cuda")`` and ``with torch.device("cuda"):`` install a ``DeviceContext``
torch-function mode that adds ``device=`` to factory calls (``torch.tensor(word_id)``,
``torch.zeros(h)``); code written without devices runs on a GPU that way. The recording mode sits
above such a mode (``with torch.device`` entered around the call, or ``set_default_device``, which
torch puts at the bottom of the mode stack) and makes per-instance factory leaves itself, so it
adds the same keyword: the recorder holds the device (:func:`factory_device`, read when the call
starts) and :func:`with_factory_device` applies it.

``torch.set_default_device`` called *inside* instance code changes the mode stack below the
recording mode; while calls record, :data:`SET_DEFAULT_DEVICE` wraps it so that the recorder of
the calling thread reads the device again (and, since each fiber keeps its own mode stack, again
whenever a fiber resumes after one did so).
"""

from __future__ import annotations

import functools

import torch

from batchcraft.autobatching import stack
from batchcraft.autobatching.patches import SharedPatch

_tf_len = torch._C._len_torch_function_stack
_tf_at = torch._C._get_function_stack_at


def factory_device() -> torch.device | None:
    """The device a ``DeviceContext`` on the mode stack gives factory calls, or None.

    The innermost ``DeviceContext`` wins, as in eager; a CPU one counts too (it also moves the
    data of ``torch.as_tensor(cuda_tensor)`` to the CPU).
    """
    try:
        from torch.utils._device import DeviceContext
    except ImportError:  # pragma: no cover - torch < 2.0
        return None
    for i in range(_tf_len() - 1, -1, -1):
        m = _tf_at(i)
        if isinstance(m, DeviceContext):
            return concrete_device(m.device)
    return None


def concrete_device(device) -> torch.device:
    """``device`` as the tensors made on it report it: ``"cuda"`` -> ``cuda:0`` (the current one),
    ``"cpu:0"`` -> ``cpu``.

    Not seen by torch-function modes (``torch.device(...)`` dispatches to them): a mode of the
    user's must not see batchcraft's own bookkeeping (reliability #123)."""
    if type(device) is torch.device and (device.index is None) == (device.type == "cpu"):
        return device
    with torch._C.DisableTorchFunction():
        dev = torch.device(device)
        if dev.type == "cpu":  # CPU tensors report no index: "cpu:0" -> cpu (reliability #179)
            return dev if dev.index is None else torch.device("cpu")
        if dev.index is not None:
            return dev
        return torch.empty(0, device=dev).device


@functools.lru_cache(maxsize=None)
def device_constructors() -> frozenset:
    """The torch functions ``DeviceContext`` adds ``device=`` to (torch's own set)."""
    try:
        from torch.utils._device import _device_constructors
    except ImportError:  # pragma: no cover - torch < 2.0
        return frozenset()
    return frozenset(_device_constructors())


def with_factory_device(func, kwargs: dict, device) -> dict:
    """``kwargs`` of ``func`` with ``device=`` added where a ``DeviceContext`` would add it."""
    if kwargs.get("device") is None and func in device_constructors():
        kwargs = dict(kwargs)
        kwargs["device"] = device
    return kwargs


_set_default_device = torch.set_default_device
_GLOBAL = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)  # torch's thread-local of set_default_device


def global_context():
    """The ``DeviceContext`` that ``torch.set_default_device`` installed on this thread (or None).

    It is thread-local in torch, so fibers share it; a fiber that calls ``set_default_device`` gets
    its own saved and put back around its switches (runtime.py), as each fiber's mode stack is.
    """
    return getattr(_GLOBAL, "device_context", None) if _GLOBAL is not None else None


def set_global_context(ctx) -> None:
    if _GLOBAL is not None:
        _GLOBAL.device_context = ctx



def _recording_set_default_device(device):
    """``torch.set_default_device`` that tells this thread's recorder (if any) to read it again."""
    _set_default_device(device)
    rec = stack.current()
    if rec is not None and not getattr(rec, "is_tracer", False) and hasattr(rec, "set_factory_device"):
        rec.device_changed = True
        rec.set_factory_device(factory_device())


_recording_set_default_device.__wrapped__ = _set_default_device
_recording_set_default_device.__doc__ = _set_default_device.__doc__

#: entered around a recording call (process-wide, other threads see the same behaviour)
SET_DEFAULT_DEVICE = SharedPatch(torch, "set_default_device", _recording_set_default_device)

__all__ = ["factory_device", "concrete_device", "device_constructors", "with_factory_device", "SET_DEFAULT_DEVICE"]
