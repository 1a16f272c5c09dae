"""Progress bars that only appear on a terminal.

A bar redrawn into a pipe or a log file becomes one line of hundreds of updates, so bars are
shown only when stderr is a terminal (``BATCHCRAFT_PROGRESS=1`` forces them, ``0`` hides them).
"""

from __future__ import annotations

import os
import sys


def progress_enabled(requested: bool = True) -> bool:
    """Whether a progress bar asked for with ``requested`` should be drawn on stderr."""
    if not requested:
        return False
    forced = os.environ.get("BATCHCRAFT_PROGRESS")
    if forced is not None:
        return forced.strip() not in ("", "0", "false", "no")
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced stderr
        return False


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs):
    """``tqdm(iterable, file=sys.stderr, leave=False, **kwargs)``, disabled unless stderr is a
    terminal (see :func:`progress_enabled`)."""
    from tqdm import tqdm

    kwargs.setdefault("leave", False)
    return tqdm(iterable, file=sys.stderr, disable=not progress_enabled(enabled), **kwargs)


__all__ = ["progress_bar", "progress_enabled"]
