"""Reading data files as UTF-8 text, with errors that name the file and line."""

from __future__ import annotations

from pathlib import Path

from batchcraft.errors import DataFormatError


def read_utf8(path: Path) -> str:
    """The file's text. Raises DataFormatError for an unreadable file or invalid UTF-8 (with line)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataFormatError(path, None, f"cannot read file: {exc.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataFormatError(path, line, f"invalid UTF-8 byte 0x{raw[exc.start]:02x}") from None
