"""Thread-local state of torch that instance code can change, per fiber and per operation.

Fibers (greenlets) share their thread, but grad mode, inference mode, autocast, the default
dtype and the torch-function mode stack are per *thread* in torch: code that switches fibers
inside ``torch.no_grad()`` would leave the next fiber, and the caller, with gradients off
(greenlet #196, PyTorch PR #49017). The runtime therefore captures a fiber's state when it
yields and restores it when it resumes, and gives the scheduler (and finally the caller) its
own state back. Context variables follow each fiber through greenlet's ``gr_context``.

:func:`op_state` is the part of the state that changes what an operation computes (grad
mode, inference mode, autocast); it is part of every signature, and groups run under it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.autograd.forward_ad as _fwad
import torch.utils._python_dispatch

from batchcraft.autobatching import stack as _stack
from batchcraft.autobatching.patches import SharedPatch
from batchcraft.errors import AutobatchError

_grad = torch.is_grad_enabled
# torch's print options live in one process-wide object; its __dict__ is compared and restored
_PRINT_OPTS = vars(torch._tensor_str.PRINT_OPTS)
_set_grad = torch._C._set_grad_enabled
_inference = torch.is_inference_mode_enabled
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
_InferenceMode = torch._C._InferenceMode
_cache_on = torch.is_autocast_cache_enabled
_default_dtype = torch.get_default_dtype
_tf_len = torch._C._len_torch_function_stack
_tf_at = torch._C._get_function_stack_at
_tf_push = torch._C._push_on_torch_function_stack
_tf_pop = torch._C._pop_torch_function_stack
_NoTF = torch._C.DisableTorchFunction
# saved-tensor hooks "disabled" (``disable_saved_tensors_hooks``): a per-thread message or None
_hooks_off = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_hooks_disable = torch._C._autograd._saved_tensors_hooks_disable
_hooks_enable = torch._C._autograd._saved_tensors_hooks_enable


_NOTHING = contextlib.nullcontext()
_peek_transform = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


#: ``is_transform_wrapped(t)``: ``t`` is a ``torch.func`` wrapper (a transform's batched or
#: dual value): it has no storage of its own (no ``data_ptr()``, no raw copies into it or out of it)
is_transform_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                               lambda x: False)


def under_transform() -> bool:
    """A ``torch.func`` transform (``jvp``, ``vmap``, ``grad``) is active in this thread.

    Inside one, eager's results differ in ways a signature records (under ``jvp`` ``lin(x)``
    does not require grad although the weight does), so signatures recorded inside and outside
    a transform must not be shared (reliability #190).
    """
    return _peek_transform() is not None


def tangents_possible() -> bool:
    """Derivatives other than autograd's may flow through batched work now: a forward-mode AD
    level is open (``dual_level``, ``torch.func.jvp``) or a ``torch.func`` transform is active.
    The raw paths (row copies and addresses, in-place products, table lookups, oneDNN) carry no
    tangent: torch would give their results none or a zero one, silently (reliability #206, #209)."""
    return _fwad._current_level >= 0 or _peek_transform() is not None


try:
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _clear_transforms
except ImportError:  # an older torch: the helper below steps aside
    _clear_transforms = None


def outside_transforms():
    """Context manager: the ``torch.func`` transforms of this thread set aside (a no-op without
    one). batchcraft's own placeholders and measurements call ``requires_grad_()``, which functorch
    refuses inside a transform; they are not the user's values, so they run outside it."""
    if _clear_transforms is None or _peek_transform() is None:
        return _NOTHING
    return _clear_transforms()


def _autocast_devices() -> tuple:
    try:
        devs = list(torch._C._autocast_supported_devices())
    except Exception:  # older torch: the two that always exist
        devs = ["cpu", "cuda"]
    ok = []
    for d in devs:
        try:
            torch.is_autocast_enabled(d)
            torch.get_autocast_dtype(d)
            ok.append(d)
        except Exception:  # device type without autocast support in this build
            pass
    return tuple(ok)


AUTOCAST_DEVICES = _autocast_devices()


def autocast_enabled_any() -> bool:
    if _any_autocast is not None:
        return _any_autocast()
    return any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES)


def autocast_state() -> tuple | None:
    """``((device, enabled, dtype), ..., ("cache", on))`` when any autocast is enabled; else None,
    or ``(("cache", False),)`` when the cast cache is off (None stands for the cache on: a fiber
    that left it off inside ``torch.autocast(..., cache_enabled=False)`` had the caller's thread
    keep it off after the call, reliability #257)."""
    if not autocast_enabled_any():
        return None if _cache_on() else (("cache", False),)
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES) + (
        ("cache", torch.is_autocast_cache_enabled()),)


def set_autocast_state(state: tuple | None) -> None:
    """Make the autocast flags and dtypes ``state`` (from :func:`autocast_state`) current.

    Autocast caches the casts of leaf tensors (weights) by tensor, not by dtype, and empties the
    cache when its outermost region exits; flags set directly skip that nesting count, so the
    cache is emptied here whenever an enabled state is left. Otherwise a weight cast to float16
    under one state was reused under a bfloat16 one (in the call, and after it in eager code).
    """
    if state is None or len(state) == 1:  # no autocast on (the cache switch on, or as given)
        if autocast_enabled_any():
            torch.clear_autocast_cache()
            for d in AUTOCAST_DEVICES:
                torch.set_autocast_enabled(d, False)
        cache = True if state is None else state[0][1]
        if _cache_on() is not cache:
            torch.set_autocast_cache_enabled(cache)
        return
    if autocast_enabled_any() and state != autocast_state():
        torch.clear_autocast_cache()
    for item in state:
        if item[0] == "cache":
            torch.set_autocast_cache_enabled(item[1])
        else:
            d, enabled, dtype = item
            torch.set_autocast_dtype(d, dtype)
            torch.set_autocast_enabled(d, enabled)


def autocast_dtypes() -> tuple:
    """``((device, dtype), ...)``: autocast's dtype per device, which is kept while it is off."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES)


def set_autocast_dtypes(dtypes: tuple) -> None:
    for d, dtype in dtypes:
        if torch.get_autocast_dtype(d) is not dtype:
            torch.set_autocast_dtype(d, dtype)


def op_state() -> tuple:
    """What changes an operation's result: ``(grad, inference, autocast or None)``."""
    inf = _inference()
    return (_grad(), inf, autocast_state() if (_any_autocast is None or _any_autocast()) else None)


PLAIN = (True, False, None)  # an op_state: grad on, no inference mode, no autocast


class _GradOnly:
    """Context manager: grad mode ``on`` inside, ``not on`` after: what :class:`run_under` does when
    only grad mode differs (it holds no state, so one object serves every nesting)."""

    __slots__ = ("on",)

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        _set_grad(self.on)
        return self

    def __exit__(self, *exc) -> bool:
        _set_grad(not self.on)
        return False


_GRAD_ON, _GRAD_OFF = _GradOnly(True), _GradOnly(False)


def under(state: tuple):
    """:class:`run_under` ``state``, or a no-op context when it is already the current state (the
    common case: two per batched group, hundreds of groups a call in models that wait often), or a
    grad-mode switch when only grad mode differs (a group recorded with grad on, run in the
    caller's ``no_grad``)."""
    if (_inference() is state[1] and state[2] is None
            and not (_any_autocast() if _any_autocast is not None else autocast_enabled_any())):
        if _grad() is state[0]:
            return _NOTHING
        return _GRAD_ON if state[0] else _GRAD_OFF
    return run_under(state)


class run_under:
    """Context manager: run batched work under a recorded :func:`op_state` (cheap when equal)."""

    __slots__ = ("state", "saved", "guard")

    def __init__(self, state: tuple):
        self.state = state

    def __enter__(self):
        grad, inf, ac = self.state
        # either way: a group recorded under inference_mode(False) inside the caller's
        # inference_mode keeps its autograd graph (reliability #258)
        self.guard = _InferenceMode(inf) if inf is not _inference() else None
        prev = autocast_state() if ac is not None or autocast_enabled_any() else None
        # the dtypes too: turning autocast off keeps the dtype it had, eager's exit restores them
        self.saved = (_grad(), prev, autocast_dtypes() if ac is not None else None)
        if ac is not None or prev is not None:
            set_autocast_state(ac)
        _set_grad(grad)
        return self

    def __exit__(self, *exc):
        grad, ac, dtypes = self.saved
        if ac is not None or self.state[2] is not None:
            set_autocast_state(ac)
            if dtypes is not None:
                set_autocast_dtypes(dtypes)
        _set_grad(grad)
        self.guard = None  # leaving inference mode restores the state before it
        return False


class FiberState:
    """The thread state of one fiber, captured when it yields (see module docstring).

    ``enter()`` makes it current before the fiber resumes, ``leave()`` captures it when the
    fiber yields and gives the scheduler ``main`` (a :class:`FiberState` of the caller) back.
    Inference mode has no setter in torch, only a guard: the scheduler creates a guard only
    while its own state is current and drops it after, so every guard restores what its
    creator expects.
    """

    __slots__ = ("grad", "inference", "autocast", "dtype", "modes", "printopts", "hooks_off", "_in_guard",
                 "_out_guard")

    def __init__(self, grad, inference, autocast, dtype, modes, printopts, hooks_off=None):
        self.hooks_off = hooks_off  # disable_saved_tensors_hooks's message (reliability #174)
        self.grad = grad
        self.inference = inference
        self.autocast = autocast
        self.dtype = dtype
        self.modes = modes
        self.printopts = printopts  # a copy of torch's print options (never mutated: replaced)
        self._in_guard = None
        self._out_guard = None

    @classmethod
    def capture(cls) -> "FiberState":
        n = _tf_len()
        return cls(_grad(), _inference(), autocast_state(), _default_dtype(),
                   tuple(_tf_at(i) for i in range(n)) if n else (), dict(_PRINT_OPTS), _hooks_off())

    def copy(self) -> "FiberState":
        return FiberState(self.grad, self.inference, self.autocast, self.dtype, self.modes, self.printopts,
                          self.hooks_off)

    def _apply(self, inference_via_guard: bool) -> None:
        cur_modes = _tf_len()
        if cur_modes != len(self.modes) or not all(_tf_at(i) is m for i, m in enumerate(self.modes)):
            for _ in range(cur_modes):
                _tf_pop()
            for m in self.modes:
                _tf_push(m)
        if _default_dtype() is not self.dtype:
            torch.set_default_dtype(self.dtype)
        if self.autocast is not None or autocast_enabled_any() or not _cache_on():
            set_autocast_state(self.autocast)
        if _PRINT_OPTS != self.printopts:  # process-wide: printoptions(...) around a wait (str() waits)
            _PRINT_OPTS.update(self.printopts)
        if _hooks_off() != self.hooks_off:
            if self.hooks_off is None:
                _hooks_enable()
            else:
                _hooks_disable(self.hooks_off)
        _set_grad(self.grad)

    def same_as(self, other: "FiberState") -> bool:
        """Equal grad mode, inference mode, autocast, default dtype and mode stack."""
        return (self.grad is other.grad and self.inference is other.inference and self.dtype is other.dtype
                and self.autocast == other.autocast and self.modes == other.modes
                and self.hooks_off == other.hooks_off
                and (self.printopts is other.printopts or self.printopts == other.printopts))

    def enter(self, main: "FiberState") -> None:
        """Before resuming the fiber: make its state current (``main``'s is current)."""
        if self._out_guard is None and self.same_as(main):
            return  # the common case: the fiber's state is the scheduler's, already current
        with _NoTF():  # the recording mode would see these calls
            self._enter(main)

    def _enter(self, main):
        if self._out_guard is not None:
            self._out_guard = None  # restores the fiber's inference mode, saved at creation
        elif self.inference != _inference():
            self._in_guard = _InferenceMode(self.inference)
        self._apply(True)

    def is_current(self) -> bool:
        """Is this state (captured without autocast) the thread's current one?"""
        modes = self.modes
        n = len(modes)
        return (_tf_len() == n and _grad() is self.grad and _inference() is self.inference
                and _default_dtype() is self.dtype
                and (self.autocast is None and not autocast_enabled_any() and _cache_on())  # (#268)
                and (n == 0 or (_tf_at(0) is modes[0] if n == 1 else all(_tf_at(i) is m for i, m in enumerate(modes))))
                and _PRINT_OPTS == self.printopts and _hooks_off() == self.hooks_off)

    def leave(self, main: "FiberState") -> None:
        """After the fiber yielded or finished: capture its state, make ``main``'s current."""
        if self._in_guard is None and main.is_current():
            # the fiber left the state as the scheduler's (the common case): nothing to restore
            self.grad, self.inference, self.autocast = main.grad, main.inference, None
            self.dtype, self.modes, self.printopts = main.dtype, main.modes, main.printopts
            self.hooks_off = main.hooks_off
            return
        with _NoTF():
            self._leave(main)

    def _leave(self, main):
        self.grad, self.inference = _grad(), _inference()
        self.autocast, self.dtype = autocast_state(), _default_dtype()
        n = _tf_len()
        self.modes = tuple(_tf_at(i) for i in range(n)) if n else ()
        self.printopts = main.printopts if _PRINT_OPTS == main.printopts else dict(_PRINT_OPTS)
        self.hooks_off = _hooks_off()
        if self._in_guard is not None:
            self._in_guard = None  # restores the scheduler's inference mode
        elif self.inference != main.inference:
            self._out_guard = _InferenceMode(main.inference)
        main._apply(True)

    def close(self) -> None:
        """Drop guards held for this fiber (it finished or was abandoned)."""
        self._out_guard = None
        self._in_guard = None


def _users(obj) -> bool:
    """``obj``'s class is not torch's own (torch's subclasses and modes are let through)."""
    return not type(obj).__module__.startswith("torch.")


_SavedHooks = torch.autograd.graph.saved_tensors_hooks
_saved_hooks_enter = _SavedHooks.__enter__


def _refusing_enter(self):
    """``saved_tensors_hooks.__enter__`` while calls record: refused in a recording thread.

    Eager packs the tensors that the operations inside the ``with`` save; batched, those
    operations run later, at a flush, as groups that mix instances, so the hooks would pack other
    work (and miss this instance's): silently different gradients (reliability #162). Torch's own
    subclasses (``save_on_cpu``, non-reentrant checkpoint's) are let through: they keep values;
    a user's subclass (bf16 packing, say) is refused like the class itself.
    """
    if (type(self) is _SavedHooks or _users(self)) and _stack.current() is not None:
        raise AutobatchError(
            "torch.autograd.graph.saved_tensors_hooks entered inside auto-batched instance code: its hooks "
            "would see batched work at other times than eager does",
            hint="enter it around the autobatched call (the hooks then see the batched tensors, once per "
                 "group), or run that part outside batchcraft.autobatch")
    return _saved_hooks_enter(self)


#: entered around a recording call (process-wide; other threads keep torch's behaviour)
SAVED_TENSORS_HOOKS = SharedPatch(_SavedHooks, "__enter__", _refusing_enter)

_DispatchMode = torch.utils._python_dispatch.TorchDispatchMode
_dispatch_enter = _DispatchMode.__enter__


def _refusing_dispatch_enter(self):
    """``TorchDispatchMode.__enter__`` while calls record: a user's mode is refused in a recording
    thread. Its handler sees aten calls; instance code's operations reach aten later, batched,
    where the mode is no longer entered (or is, for other instances' work): a mode that changes
    results gave silently different values (reliability #171). Torch's own modes (the flop
    counter's, fake tensors of a compile) are let through; they see the batched work."""
    if _users(self) and _stack.current() is not None:
        raise AutobatchError(
            f"a TorchDispatchMode ({type(self).__name__}) entered inside auto-batched instance code: it would "
            "see batched work at other times than eager does",
            hint="enter it around the autobatched call (the instances then run one at a time, each seen by "
                 "the mode), or run that part outside batchcraft.autobatch")
    return _dispatch_enter(self)


DISPATCH_MODES = SharedPatch(_DispatchMode, "__enter__", _refusing_dispatch_enter)

__all__ = ["PLAIN", "op_state", "tangents_possible", "under_transform", "outside_transforms", "SAVED_TENSORS_HOOKS", "DISPATCH_MODES", "under", "autocast_dtypes", "set_autocast_dtypes", "run_under", "FiberState", "autocast_state", "set_autocast_state", "AUTOCAST_DEVICES"]
