"""The recording mode: routes every torch call of instance code to its recorder.

Calls on lazy values reach the recorder through the lazy class's ``__torch_function__``; the
mode also sees *factory* calls whose arguments are not lazy (``torch.tensor(word_id)``,
``torch.zeros(n)``), which become per-instance leaves. One mode is pushed by the scheduler
for the whole call; fibers run under it (REFERENCES §6: a ``with mode:`` per fiber would
interleave enter/exit between fibers). The C core has its own mode object, whose
``__torch_function__`` is a C method.
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from batchcraft.autobatching import stack


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
