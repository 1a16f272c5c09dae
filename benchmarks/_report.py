"""Shared helpers for benchmark scripts: results JSON and docs/benchmarks.md sections."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def save_json(name: str, payload: dict) -> Path:
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    p = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    p.write_text(json.dumps(payload, indent=2))
    return p


def write_section(marker: str, text: str, doc: Path | None = None) -> None:
    """Replace the text between <!-- marker:start --> and <!-- marker:end --> (appended if absent)."""
    doc = doc or ROOT / "docs" / "benchmarks.md"
    body = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in body and end in body:
        body = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda m: block, body, flags=re.S)
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    doc.write_text(body)
