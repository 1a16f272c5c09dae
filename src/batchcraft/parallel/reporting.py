"""How a program tells ``batchcraft tune -- COMMAND`` how much work it has done: :func:`report`.

Under the tuner each instance of the program has BATCHCRAFT_REPORT_FILE in its environment;
:func:`report` appends one line ``<monotonic seconds> <items>`` to it (one ``os.write`` on a file
opened for appending: lines of several processes or threads do not mix). The tuner reads the
lines after the run (:mod:`batchcraft.parallel.program`). Outside the tuner it does nothing, so
the call can stay in the program.
"""

from __future__ import annotations

import os
import time

__all__ = ["report", "REPORT_ENV"]

REPORT_ENV = "BATCHCRAFT_REPORT_FILE"
_state = {"fd": None, "pid": None, "path": None}


def report(items: float = 1) -> None:
    """Count ``items`` more items done (e.g. the batch just served) for ``batchcraft tune``.

    Args:
        items (int | float): items finished since the previous call (>= 0). Default: 1.
    Raises:
        ValueError: a negative or non-numeric count.
    Example:
        >>> for batch in batches:
        ...     model(batch)
        ...     batchcraft.parallel.report(len(batch))
    """
    if isinstance(items, bool) or not isinstance(items, (int, float)) or not items >= 0:
        raise ValueError(f"report: items must be a number >= 0, got {items!r}")
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    st = _state
    if st["fd"] is None or st["pid"] != os.getpid() or st["path"] != path:  # first call, or a forked child
        st.update(fd=os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), pid=os.getpid(), path=path)
    os.write(st["fd"], f"{time.monotonic():.6f} {items}\n".encode())
