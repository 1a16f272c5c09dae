"""The recording mode: routes every torch call of instance code to its recorder.

Calls on lazy values reach the recorder through the lazy class's ``__torch_function__``; the
mode also sees *factory* calls whose arguments are not lazy (``torch.tensor(word_id)``,
``torch.zeros(n)``), which become per-instance leaves. One mode is pushed by the scheduler
for the whole call; fibers run under it (REFERENCES §6: a ``with mode:`` per fiber would
interleave enter/exit between fibers). The C core has its own mode object, whose
``__torch_function__`` is a C method.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from batchcraft.autobatching import stack

#: returned by :func:`as_mode_handler` when the recorder's mode is not the innermost one
NOT_ON_TOP = object()


class RecordingMode(TorchFunctionMode):
    """Sends each torch call to the active recorder's ``mode_call``."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rec = stack.current()
        if rec is None:  # batched execution inside the run: calls run as they are
            return func(*args, **(kwargs or {}))
        return rec.mode_call(func, args, kwargs or {})


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
