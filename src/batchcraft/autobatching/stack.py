"""The stack of active recorders, one per thread.

Instance code reaches the recorder of the ``autobatch`` call it runs in through
:func:`current`; static-block tracing pushes its own recorder on top, and execution
pushes ``None`` so that blocks called from batched code run instead of recording.
Fibers of one call share their thread's stack (the scheduler switches between them).
The C core keeps this stack itself (its lazy operators read it without a Python call);
this module is the one door to it for Python code.
"""

from __future__ import annotations

import threading

from batchcraft.autobatching import _native

if _native.core is not None:
    current = _native.core.current
    push = _native.core.push
    pop = _native.core.pop
else:
    _tls = threading.local()

    def current():
        """The innermost active recorder of this thread, or None."""
        s = getattr(_tls, "stack", None)
        return s[-1] if s else None

    def push(rec) -> None:
        """Make ``rec`` (a recorder, or None) the active recorder of this thread."""
        s = getattr(_tls, "stack", None)
        if s is None:
            s = _tls.stack = []
        s.append(rec)

    def pop() -> None:
        """Undo the last :func:`push` of this thread."""
        _tls.stack.pop()

__all__ = ["current", "push", "pop"]
