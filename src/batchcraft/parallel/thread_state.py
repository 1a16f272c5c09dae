"""The caller's thread-local torch state, carried into the inter-op executor's pool threads.

PyTorch keeps grad mode, inference mode, autocast (enabled flag and dtype per device type, the
cast cache flag) and the torch-function mode stack per *thread*; a thread pool does not inherit
them (FIELD-FAULTS "worker threads without the caller's modes", PyTorch #50170: a bfloat16
autocast region ran its pooled work in float32). :meth:`ThreadState.capture` records them in the
calling thread, :meth:`ThreadState.run` runs a function in another thread under them, and puts
that thread back as it was. ``contextvars`` are carried too: each run gets a copy of the caller's
context (values the caller set are seen; values set inside do not flow back, since pooled tasks
run concurrently). The default dtype (``torch.set_default_dtype``) is process-wide in PyTorch and
needs no carrying.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

__all__ = ["ThreadState", "AUTOCAST_DEVICES"]


def _autocast_devices() -> tuple[str, ...]:
    try:
        from torch.amp.autocast_mode import is_autocast_available
    except ImportError:  # older torch
        return ("cpu", "cuda")
    out = []
    for d in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            if is_autocast_available(d):
                torch.is_autocast_enabled(d)
                out.append(d)
        except (RuntimeError, TypeError):
            pass
    return tuple(out)


AUTOCAST_DEVICES = _autocast_devices()


@dataclass(frozen=True)
class ThreadState:
    """Thread-local torch state of the thread that captured it (see the module docstring)."""

    grad: bool
    inference: bool
    autocast: tuple  # (device type, dtype) of every device type with autocast enabled
    autocast_cache: bool
    function_modes: tuple
    context: contextvars.Context

    @classmethod
    def capture(cls) -> "ThreadState":
        from torch.overrides import _get_current_function_mode_stack

        enabled = tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
        return cls(grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(), autocast=enabled,
                   autocast_cache=torch.is_autocast_cache_enabled(),
                   function_modes=tuple(_get_current_function_mode_stack()),
                   context=contextvars.copy_context())

    @contextlib.contextmanager
    def applied(self):
        """This state in the current thread for the ``with`` block; the thread's own state after."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=self.autocast_cache))
            pushed = 0
            try:
                for mode in self.function_modes:
                    torch._C._push_on_torch_function_stack(mode)
                    pushed += 1
                yield
            finally:
                for _ in range(pushed):
                    torch._C._pop_torch_function_stack()

    def run(self, fn, *args):
        """``fn(*args)`` under this state, in a copy of the captured ``contextvars`` context."""
        def body():
            with self.applied():
                return fn(*args)
        return self.context.copy().run(body)
