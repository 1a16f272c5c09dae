"""One attribute swapped process-wide while calls record, shared by nested and concurrent calls.

Used for ``nn.Module.__getattr__`` (attrs.py) and, opt-in, ``torch.tensor`` (ccore.py): the first
call to enter installs the replacement, the last to leave restores the original; an attribute
someone else changed in between is left as they set it.
"""

from __future__ import annotations

import threading


class SharedPatch:
    """Context manager: ``target.name`` is ``replacement`` while at least one holder is inside.

    Args:
        target: a module or class (its own ``__dict__`` entry is swapped, not an inherited one).
        name (str): the attribute.
        replacement: the value while patched (None: the patch does nothing).
    """

    __slots__ = ("target", "name", "replacement", "original", "depth", "lock")

    def __init__(self, target, name: str, replacement):
        self.target, self.name, self.replacement = target, name, replacement
        self.original = vars(target).get(name)
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
                setattr(self.target, self.name, self.original)
        return False


__all__ = ["SharedPatch"]
