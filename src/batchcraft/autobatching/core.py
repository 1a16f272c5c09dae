"""Which recording core runs a call: the C core when it was built, else the Python one."""

from __future__ import annotations

from batchcraft.autobatching import _native
from batchcraft.errors import ConfigurationError


def core_name(requested: str = "auto") -> str:
    """``"c"`` or ``"python"`` for the requested core (``"auto"``: C when available)."""
    if requested == "python":
        return "python"
    if requested == "c" and not _native.available:
        raise ConfigurationError(f"autobatch: core='c' requested but the C core is {_native.reason}",
                                 hint="reinstall with a C compiler (pip install -e .), or use core='auto'")
    return "c" if _native.available else "python"


def make_recorder(runtime, options):
    """A new recorder for one call."""
    if core_name(options.core) == "c":
        from batchcraft.autobatching.ccore import CRecorder

        return CRecorder(runtime, options)
    from batchcraft.autobatching.recorder import PyRecorder

    return PyRecorder(runtime, options)
