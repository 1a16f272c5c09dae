"""``torch.nn.functional``'s Python-level dispatch to the recording mode, made direct.

Many functions of ``torch.nn.functional`` are Python (``F.relu``, ``F.embedding``,
``F.layer_norm``, ``F.dropout``, ``F.softmax``, so ``nn.ReLU``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.Dropout``...). On a lazy value they call ``torch.overrides.handle_torch_function``, which
collects the overloaded arguments, enters a context manager that pops the mode, and calls the
mode: about 1.7 µs a call here, on top of the recording itself. While a call records,
:data:`FAST_DISPATCH` sets ``torch.nn.functional.handle_torch_function`` (the module global
those functions read) to a function that, when the innermost mode is this thread's active
recorder's, pops it and hands the call to the recorder as the mode would. Everything else
(other threads, a mode of the user's on top, a static block's tracer, batched execution) goes
to torch's own function, unchanged.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import torch.overrides

from batchcraft.autobatching import stack as _stack
from batchcraft.autobatching.mode import NOT_ON_TOP, TF_NAME, as_mode_handler, has_lazy, import_body
from batchcraft.autobatching.patches import SharedPatch

_original = torch.overrides.handle_torch_function


def handle_torch_function(public_api, relevant_args, *args, **kwargs):
    """As :func:`torch.overrides.handle_torch_function`, direct when the recorder's mode is on top."""
    rec = _stack.current()
    frame = sys._getframe(1)  # the F.* function

    def record():
        caller = frame.f_back
        if caller is not None and caller.f_code.co_name == TF_NAME:  # maybe a user mode's handler (bug #56)
            result = rec.for_handler(public_api, args, kwargs, frame)
        elif import_body(caller) and not has_lazy(args, kwargs, rec.lazy_type):
            result = public_api(*args, **kwargs)  # an imported module's body: plain tensors (#313)
        else:
            result = rec.record(public_api, args, kwargs)  # as the mode would (F.* is not a factory)
        if result is NotImplemented:  # the subclasses' turn, the mode still off, as in torch
            result = _original(public_api, relevant_args, *args, **kwargs)
        return result

    result = NOT_ON_TOP if rec is None else as_mode_handler(rec, record)
    return _original(public_api, relevant_args, *args, **kwargs) if result is NOT_ON_TOP else result


#: enter/exit around a recording call
FAST_DISPATCH = SharedPatch(F, "handle_torch_function", handle_torch_function)

__all__ = ["FAST_DISPATCH", "handle_torch_function"]
