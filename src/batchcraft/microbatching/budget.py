"""Parse workspace budgets: ``"64MiB"``, ``"1.5GiB"``, ``"512KB"``, ``"0"`` or a byte count."""

from __future__ import annotations

import math
import re

from batchcraft.errors import WorkspaceError

__all__ = ["parse_budget", "format_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_budget(value, *, name: str = "workspace_limit") -> int:
    """Bytes of a workspace budget.

    Args:
        value (int | float | str): bytes (int, or a float with no fraction), or a string with a
            unit: B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2); case-insensitive.
    Returns:
        int: bytes, >= 0 (fractions of a byte are rounded down).
    Raises:
        WorkspaceError: negative, not finite, a bool, or an unknown unit (the message lists them).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise WorkspaceError(f"{name}: expected bytes (int) or a size string like '64MiB', got {value!r}")
    if isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise WorkspaceError(
                f"{name}: cannot read {value!r} as a size",
                hint="use a number with one of the units B, KB, MB, GB, KiB, MiB, GiB (e.g. '64MiB')")
        number = float(m.group(1)) * _UNITS[unit]
    else:
        number = float(value)
    if not math.isfinite(number) or number < 0:
        raise WorkspaceError(f"{name}: must be a finite size >= 0 bytes, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary units (``"64.0 MiB"``)."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
