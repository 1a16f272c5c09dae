"""Process-wide changes held while calls record, shared by nested and concurrent calls.

:class:`SharedPatch` swaps one attribute; :class:`ModuleClassPatch` gives a module a subclass of
``ModuleType`` (whose data descriptors then see reads of the module's attributes: ``torch.tensor``
in ccore.py). The first call to enter installs, the last to leave restores; what someone else
changed in between is left as they set it.
"""

from __future__ import annotations

import threading
import types


class SharedPatch:
    """Context manager: ``target.name`` is ``replacement`` while at least one holder is inside.

    Args:
        target: a module or class (its own ``__dict__`` entry is swapped, not an inherited one).
        name (str): the attribute.
        replacement: the value while patched (None: the patch does nothing).
    """

    __slots__ = ("target", "name", "replacement", "original", "present", "depth", "lock")

    def __init__(self, target, name: str, replacement):
        self.target, self.name, self.replacement = target, name, replacement
        self.original = vars(target).get(name)
        self.present = name in vars(target)  # else inherited: deleted again on exit (``__call__``)
        self.depth = 0
        self.lock = threading.Lock()

    def __enter__(self) -> "SharedPatch":
        if self.replacement is None:
            return self
        with self.lock:
            if self.depth == 0 and vars(self.target).get(self.name) is self.original:
                setattr(self.target, self.name, self.replacement)
            self.depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        if self.replacement is None:
            return False
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and vars(self.target).get(self.name) is self.replacement:
                if self.present:
                    setattr(self.target, self.name, self.original)
                else:
                    delattr(self.target, self.name)
        return False


class PatchSet:
    """Enter/exit several :class:`SharedPatch` as one (exit in reverse order)."""

    def __init__(self, patches):
        self.patches = tuple(patches)

    def __enter__(self) -> "PatchSet":
        for p in self.patches:
            p.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        for p in reversed(self.patches):
            p.__exit__(*exc)
        return False


class ModuleClassPatch:
    """Context manager: ``module.__class__`` is ``cls`` while at least one holder is inside.

    Only a module whose class is exactly ``types.ModuleType`` is changed (another class means a
    library of the user's owns it: the patch then does nothing, and :attr:`active` stays False).

    Args:
        module: the module (e.g. ``torch``).
        cls: a subclass of ``types.ModuleType`` adding no slots.
    """

    __slots__ = ("module", "cls", "depth", "lock", "active")

    def __init__(self, module, cls):
        self.module, self.cls = module, cls
        self.depth = 0
        self.active = False
        self.lock = threading.Lock()

    def __enter__(self) -> "ModuleClassPatch":
        with self.lock:
            if self.depth == 0 and type(self.module) is types.ModuleType:
                self.module.__class__ = self.cls
                self.active = True
            self.depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                if type(self.module) is self.cls:
                    self.module.__class__ = types.ModuleType
                self.active = False
        return False


class WrappedAttr:
    """Data descriptor for a :class:`ModuleClassPatch` class: ``module.<name>`` reads as
    ``wrapper`` while the module's own entry is still ``original`` and :meth:`wanted` agrees,
    else as the entry (a value set meanwhile is read as set). The wrapper written back stores
    the original (``saved = torch.f; ...; torch.f = saved``).

    Args:
        name (str): the attribute.
        original: the module's own value.
        wrapper: what readers get instead.
    """

    __slots__ = ("name", "original", "wrapper")

    def __init__(self, name: str, original, wrapper):
        self.name, self.original, self.wrapper = name, original, wrapper

    def wanted(self, depth: int) -> bool:
        """Whether this read gets the wrapper (the reader is ``sys._getframe(depth)`` here)."""
        return True

    def __get__(self, module, owner=None):
        if module is None:
            return self
        try:
            v = module.__dict__[self.name]
        except KeyError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {self.name!r}") from None
        return self.wrapper if v is self.original and self.wanted(2) else v

    def __set__(self, module, value) -> None:
        module.__dict__[self.name] = self.original if value is self.wrapper else value

    def __delete__(self, module) -> None:
        del module.__dict__[self.name]


__all__ = ["SharedPatch", "PatchSet", "ModuleClassPatch", "WrappedAttr"]
