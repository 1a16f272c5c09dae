"""Plain-text and markdown tables for results."""

from __future__ import annotations

from typing import Sequence


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.2e}"
        return f"{v:.2f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], *, markdown: bool = False) -> str:
    """Render rows as an aligned text table (or a markdown table)."""
    cells = [[_fmt(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    if markdown:
        out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(out)
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric))
            for r in cells]
    return "\n".join(out)
