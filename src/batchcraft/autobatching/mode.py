"""The recording mode: routes every torch call of instance code to its recorder.

Calls on lazy values reach the recorder through the lazy class's ``__torch_function__``; the
mode also sees *factory* calls whose arguments are not lazy (``torch.tensor(word_id)``,
``torch.zeros(n)``), which become per-instance leaves. One mode is pushed by the scheduler
for the whole call; fibers run under it (REFERENCES §6: a ``with mode:`` per fiber would
interleave enter/exit between fibers). The C core has its own mode object, whose
``__torch_function__`` is a C method.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from batchcraft.autobatching import _native, stack

#: returned by :func:`as_mode_handler` when the recorder's mode is not the innermost one
NOT_ON_TOP = object()

#: torch's package directory: frames there are skipped when looking for the caller of a torch call
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: batchcraft's package directory (a module call's Python path runs there)
OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
TF_NAME = "__torch_function__"
_CO_OPTIMIZED = inspect.CO_OPTIMIZED


def handler_mode(frame):
    """The mode of the user's whose ``__torch_function__`` made the torch call that ``frame``
    (torch's frames above it skipped) is in, else None.

    torch runs a mode's handler with the mode off the stack, so the recording mode sees the
    handler's ``func(*args)``; called with lazy values, its result must be a tensor, as in eager
    (bug #56). A Tensor subclass's handler (no mode) and batchcraft's own mode are not it.
    """
    for _ in range(4):
        if frame is None:
            return None
        co = frame.f_code
        if co.co_name == TF_NAME:
            owner = frame.f_locals.get("self")
            ok = isinstance(owner, TorchFunctionMode) and not isinstance(owner, RecordingMode)
            return owner if ok else None
        if not co.co_filename.startswith(TORCH_DIR):
            return None
        frame = frame.f_back
    return None


def import_body(frame) -> bool:
    """Whether the torch call that ``frame`` (torch's frames above it skipped) is in comes from the
    body of a module being imported (an import inside instance code: ``EPS = torch.tensor(1e-3)``
    at module level), whose tensors eager keeps as plain tensors (reliability #313). Class bodies
    and ``exec``'d code run per instance and record as functions do."""
    for _ in range(8):
        if frame is None:
            return False
        co = frame.f_code
        if not co.co_filename.startswith(TORCH_DIR) and not co.co_filename.startswith(OWN_DIR):
            if co.co_flags & _CO_OPTIMIZED or co.co_name != "<module>":
                return False
            spec = frame.f_globals.get("__spec__")
            return bool(getattr(spec, "_initializing", False)) if spec is not None else False
        frame = frame.f_back
    return False


def has_lazy(args, kwargs, lazy_type, depth: int = 0) -> bool:
    """Whether a lazy value is among ``args`` (in lists, tuples and dicts inside them, to a depth
    of 4 and 256 items each) or ``kwargs``' values; True also where the walk stops early."""
    for a in (args if depth or not kwargs else (*args, *kwargs.values())):
        if isinstance(a, lazy_type):
            return True
        t = type(a)
        if t in (list, tuple, dict) and a:
            items = a.values() if t is dict else a
            if depth >= 3 or len(a) > 256 or has_lazy(tuple(items), None, lazy_type, depth + 1):
                return True
    return False


class RecordingMode(TorchFunctionMode):
    """Sends each torch call to the active recorder's ``mode_call``."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rec = stack.current()
        if rec is None:  # batched execution inside the run: calls run as they are
            return func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        if handler_mode(frame) is not None:  # a mode of the user's handler called func (bug #56)
            return rec.for_handler(func, args, kwargs or {}, frame)
        if import_body(frame) and not has_lazy(args, kwargs, rec.lazy_type):
            return func(*args, **(kwargs or {}))  # import-time code: plain tensors, as in eager
        return rec.mode_call(func, args, kwargs or {})


#: the mode classes of the two cores (C: ``_core.Mode``)
_MODE_TYPES = (RecordingMode,) + ((_native.core.Mode,) if _native.core is not None else ())


def recording_here() -> bool:
    """Whether this thread's torch calls reach a recorder now: one is active, torch functions are
    enabled, and the innermost torch-function mode is batchcraft's (the Python core's
    :class:`RecordingMode` or the C core's mode), not a mode of the user's."""
    if stack.current() is None or not torch._C._is_torch_function_enabled():
        return False
    n = torch._C._len_torch_function_stack()
    return n > 0 and type(torch._C._get_function_stack_at(n - 1)) in _MODE_TYPES


def as_mode_handler(rec, fn):
    """``fn()`` as inside the recording mode's handler: ``rec``'s mode off the stack (so reads of a
    tensor's ``requires_grad`` are not recorded), put back after. :data:`NOT_ON_TOP` (``fn`` not
    run) when another mode is innermost: a mode of the user's then sees the call its own way.

    Used by code that records on the mode's behalf without going through torch's dispatch
    (``cells.py``, ``dispatch.py``). Not ``DisableTorchFunction``: recording may switch fibers
    (a value needed by shape inference), and the mode stack is part of each fiber's saved state
    where the disabled flag is not.
    """
    mode = getattr(rec, "mode", None)
    n = torch._C._len_torch_function_stack()
    if mode is None or not n or torch._C._get_function_stack_at(n - 1) is not mode:
        return NOT_ON_TOP
    torch._C._pop_torch_function_stack()
    try:
        return fn()
    finally:
        torch._C._push_on_torch_function_stack(mode)


class outside_mode:
    """Context manager: ``rec``'s recording mode off torch's mode stack, the modes above it kept
    in order; put back at its place on exit (also when the body raises).

    A call run for a mode of the user's on concrete values (``recorder.under_user_mode``) must
    not be recorded on the way: the mode's handler then sees real tensors as results, as in eager
    (bug #56). A no-op when the recorder has no mode or it is not on the stack.
    """

    __slots__ = ("mode", "above")

    def __init__(self, rec):
        self.mode = getattr(rec, "mode", None)
        self.above = None

    def __enter__(self):
        mode = self.mode
        n = torch._C._len_torch_function_stack()
        if mode is None or not any(torch._C._get_function_stack_at(i) is mode for i in range(n)):
            return self
        above = []
        while True:
            top = torch._C._pop_torch_function_stack()
            if top is mode:
                break
            above.append(top)
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)
        self.above = above
        return self

    def __exit__(self, *exc):
        above = self.above
        if above is None:
            return False
        self.above = None
        for _ in above:
            torch._C._pop_torch_function_stack()
        torch._C._push_on_torch_function_stack(self.mode)
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)
        return False
