"""Load the optional C core (``batchcraft.autobatching._core``).

It is built by ``pip install`` when a C compiler is available; without it (or with
``BATCHCRAFT_NO_EXT=1`` in the environment, read at import) batchcraft uses the pure-Python
core, which is also the reference the fuzzer compares the C core against.
"""

from __future__ import annotations

import importlib.util
import os

core = None
reason = "not built"
if os.environ.get("BATCHCRAFT_NO_EXT", "").strip() not in ("", "0"):
    reason = "disabled by BATCHCRAFT_NO_EXT"
else:
    try:
        from batchcraft.autobatching import _core as core  # type: ignore[attr-defined]

        reason = ""
    except ImportError as exc:  # no compiler at install time: pure-Python core
        core = None
        if importlib.util.find_spec("batchcraft.autobatching._core") is None:
            # (Python's own message for a missing submodule speaks of a circular import)
            reason = "not built (no compiled _core in the package: the install had no C compiler)"
        else:
            reason = f"built but not loadable ({exc})"

available = core is not None
