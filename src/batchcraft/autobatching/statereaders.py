"""torch's thread-state accessors for the C core, found by symbol and checked before use.

The C core asks torch's thread state several times per recorded call: grad mode, autocast and
inference mode for a static block's signature and the torch-function mode stack's length (a
block call asks four questions), and whether its mode is innermost (a ``torch.tensor`` read and
call ask four more).
Through torch's builtins (``torch.is_grad_enabled`` and friends) each answer costs about 35 ns
here, most of it torch's error and warning handlers around a one-byte read: about 0.4 µs of a
TreeLSTM node's 3.3 µs of recording.

:func:`install` looks up the C++ functions behind those builtins in torch's own libraries
(``c10::GradMode::is_enabled`` and four others, :data:`SYMBOLS`), hands their addresses to the
core, and compares the core's answers with the builtins' in every combination of grad mode,
inference mode, ``DisableTorchFunction`` / ``DisableTorchFunctionSubclass`` and zero to two
function modes, in this thread and a new one. Any symbol missing or any answer different, and
the core goes on asking the builtins: nothing depends on a torch version's layout, only on
functions that take no argument and return a bool or an integer (as ``rowmm`` finds MKL's
``cblas_sgemm_batch``).

Autocast has no such accessor (``at::autocast::is_autocast_enabled`` takes a device type and
throws for one it does not know). torch keeps each device's switch as one bit of the thread's
local dispatch-key set, a thread-local pair of words the library exports
(:data:`DISPATCH_KEYS_SYMBOL`). :func:`learn_autocast_bits` switches each device's autocast on
and off once and notes which bit of the excluded word moves; the core then answers "any autocast
on" from those bits, checked like the rest (here also with each device's autocast on). A device
that moves no single bit, or one bit too many, and the builtin stays. While autocast is on, the
core keys signatures by the devices on and their dtypes (:class:`AutocastKeys`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
from contextlib import ExitStack

import torch
from torch.overrides import TorchFunctionMode

#: (library, symbol) of grad mode, inference mode, "function modes enabled", the torch-function
#: disabled state (0: enabled) and the function-mode stack length, in the order the core takes them
SYMBOLS = (
    ("c10", "_ZN3c108GradMode10is_enabledEv"),
    ("c10", "_ZN3c1013InferenceMode10is_enabledEv"),
    ("torch_cpu", "_ZN2at4impl27torch_function_mode_enabledEv"),
    ("torch_cpu", "_ZN2at4impl22PythonTorchFunctionTLS18get_disabled_stateEv"),
    ("torch_cpu", "_ZN2at4impl22PythonTorchFunctionTLS9stack_lenEv"),
)


#: (library, symbol) of the thread's local dispatch-key set (two 64-bit words: included, excluded)
DISPATCH_KEYS_SYMBOL = ("c10", "_ZN3c104impl26raw_local_dispatch_key_setE")

#: device types whose autocast switch can be set by name; torch's "any autocast" counts some of them
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "ipu", "hpu", "xla", "mps", "mtia", "maia", "privateuseone")


def _library(lib: str):
    path = os.path.join(os.path.dirname(torch.__file__), "lib",
                        f"lib{lib}{'.dylib' if sys.platform == 'darwin' else '.so'}")
    return ctypes.CDLL(path) if os.path.exists(path) else None


def find() -> tuple | None:
    """The addresses of :data:`SYMBOLS` in the loaded torch libraries, or None if one is missing."""
    libs: dict = {}
    out = []
    for lib, symbol in SYMBOLS:
        try:
            if lib not in libs:
                libs[lib] = _library(lib)
            handle = libs[lib]
            address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value if handle is not None else None
        except (OSError, AttributeError):
            return None
        if not address:
            return None
        out.append(address)
    return tuple(out)


def builtin_state() -> tuple:
    """The state as torch's builtins give it, in the core's ``read_state()`` order."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch._C._is_any_autocast_enabled(),
            torch._C._is_torch_function_enabled(), torch._C._is_torch_function_mode_enabled(),
            torch._C._len_torch_function_stack())


def _autocast_on(device: str, stack: ExitStack) -> bool:
    """Switch ``device``'s autocast on until ``stack`` closes; False if torch refuses the name."""
    try:
        prev = torch.is_autocast_enabled(device)
        torch.set_autocast_enabled(device, True)
    except (RuntimeError, ValueError, TypeError):
        return False
    stack.callback(torch.set_autocast_enabled, device, prev)
    return True


def learn_autocast_bits(words) -> tuple | None:
    """``(mask, off, bits)``: the excluded-word bits of the devices torch's "any autocast" counts,
    their values with autocast off, and ``{device: its bit}``; None when a device's switch is not
    one bit of that word. ``words()`` reads the thread's (included, excluded) pair. Autocast must
    be off on entry."""
    if torch._C._is_any_autocast_enabled():
        return None
    inc0, exc0 = words()
    mask, bits = 0, {}
    for device in AUTOCAST_DEVICES:
        with ExitStack() as stack:
            if not _autocast_on(device, stack):
                continue
            counted = torch._C._is_any_autocast_enabled()
            inc1, exc1 = words()
        moved = exc1 ^ exc0
        if inc1 != inc0 or moved == 0 or moved & (moved - 1) or words() != (inc0, exc0):
            return None
        if counted:
            mask |= moved
            bits[device] = moved
    return (mask, exc0 & mask, bits) if mask else None


class AutocastKeys:
    """``keys(word) -> int``: a small id of the autocast state that changes an operation's result,
    for the C core's signature keys while autocast is on (before, every call under autocast took
    the Python path, about 10-17 µs).

    ``word`` is the core's reading of the devices' switches (bit ``bits[device]`` set: that
    device's autocast is on). The id stands for the devices that are on, each one's autocast
    dtype, and the cast cache switch; two states with the same id give every operation the same
    result (a device whose autocast is off casts nothing, whatever its dtype). The Python core's
    signatures keep the whole :func:`~batchcraft.autobatching.threadstate.autocast_state`, so a
    signature inferred under one state may serve another with the same id: its group then runs
    under the first state, with the same values. At most :attr:`MAX_KEYS` ids, then None (the
    slow path, as before).

    Args:
        bits (dict): ``{device: its bit}`` from :func:`learn_autocast_bits`.
    """

    MAX_KEYS = 4096
    #: (devices, dtypes, cache) -> id, for the process: the core's signature table outlives any one
    #: instance (statereaders.install may run again), so an id never changes its meaning
    _ids: dict = {}
    _next = itertools.count(1)  # (atomic: threads that add keys at once get distinct ids)

    def __init__(self, bits: dict):
        self.bits = dict(bits)
        self._devices: dict = {}  # word -> the devices on

    def __call__(self, word: int) -> int | None:
        devices = self._devices.get(word)
        if devices is None:
            devices = self._devices[word] = tuple(d for d, bit in self.bits.items() if word & bit)
        key = (devices, tuple(map(torch.get_autocast_dtype, devices)), torch.is_autocast_cache_enabled())
        i = self._ids.get(key)
        if i is None:
            if len(self._ids) >= self.MAX_KEYS:
                return None
            i = self._ids.setdefault(key, next(self._next))
        return i


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_TF = (None, torch._C.DisableTorchFunctionSubclass, torch._C.DisableTorchFunction)


def _disagreements(core) -> list:
    """The states (as tuples of settings) in which ``core.read_state()`` differs from the builtins."""
    bad = []
    for grad, inference, tf, modes, ac in itertools.product((True, False), (False, True), range(3), range(3),
                                                           (None,) + AUTOCAST_DEVICES):
        if ac is not None and (tf or modes):  # (autocast crossed with grad and inference mode only)
            continue
        with ExitStack() as stack:  # (the builtins asked are not overridable: the modes do not see them)
            if ac is not None and not _autocast_on(ac, stack):
                continue
            for _ in range(modes):
                stack.enter_context(_PassThrough())
            if inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(grad))
            if tf:
                stack.enter_context(_TF[tf]())
            if core.read_state() != builtin_state():
                bad.append((grad, inference, tf, modes))
        if core.read_state() != builtin_state():  # and after leaving them
            bad.append(("after", grad, inference, tf, modes))
    return bad


def agrees(core) -> bool:
    """Does the core read the same state as torch's builtins, here and in a new thread?"""
    if _disagreements(core):
        return False
    found: list = []
    t = threading.Thread(target=lambda: found.append(_disagreements(core)), name="batchcraft-state-check")
    t.start()
    t.join()
    return found == [[]]


def _autocast_reader(core) -> None:
    """Set the core's autocast reader when the dispatch-key set is found and its bits learnt."""
    lib, symbol = DISPATCH_KEYS_SYMBOL
    try:
        handle = _library(lib)
        if handle is None or not hasattr(core, "set_autocast_reader"):
            return
        core.set_autocast_reader((handle._handle, symbol, 0, 0))  # (mask 0: read the words, answer nothing)
        bits = learn_autocast_bits(core.dispatch_key_words)
    except (OSError, AttributeError, RuntimeError):
        return
    if bits is not None:
        core.set_autocast_reader((handle._handle, symbol) + bits[:2])
        if hasattr(core, "set_autocast_key"):
            core.set_autocast_key(AutocastKeys(bits[2]))


def install(core) -> bool:
    """Give ``core`` torch's C++ state accessors when found and checked; True when in use
    (:func:`agrees` over every state, the autocast bits included, else the builtins)."""
    addresses = find()
    if addresses is None:
        return False
    core.set_state_readers(addresses)
    _autocast_reader(core)
    try:
        ok = agrees(core)
    except Exception:  # a check that cannot run: the builtins
        ok = False
    if not ok:
        core.set_state_readers(None)
        core.set_autocast_reader(None)
        if hasattr(core, "set_autocast_key"):
            core.set_autocast_key(None)
    return ok


__all__ = ["SYMBOLS", "DISPATCH_KEYS_SYMBOL", "AUTOCAST_DEVICES", "find", "builtin_state", "learn_autocast_bits",
           "AutocastKeys", "agrees", "install"]
