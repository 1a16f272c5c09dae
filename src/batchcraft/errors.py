"""Error tree of batchcraft.

Every error says what was wrong (the bad value), where (instance, node, layer,
file:line), which rule broke and what to do. Each class also inherits the
matching builtin so ``except ValueError`` keeps working, and carries a
kebab-case ``code`` used by the CLI's ``--json`` error object.
"""

from __future__ import annotations

__all__ = [
    "BatchcraftError",
    "DataFormatError",
    "TreeStructureError",
    "AutobatchError",
    "UnsupportedOperationError",
    "InstanceError",
    "StepLimitError",
    "WorkspaceError",
    "MeasurementCacheError",
    "ConfigurationError",
    "WorkerError",
]


class BatchcraftError(Exception):
    """Root of all batchcraft errors.

    Attributes:
        code (str): kebab-case identifier, stable across releases.
        hint (str | None): what the user can do about it.
    """

    code = "batchcraft-error"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")
        self.message = message
        self.hint = hint

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "hint": self.hint}


class DataFormatError(BatchcraftError, ValueError):
    """A data file is malformed; the message names the file and line."""

    code = "data-format"

    def __init__(self, path, line: int | None, message: str, *, hint: str | None = None):
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}", hint=hint)
        self.path = str(path)
        self.line = line


class TreeStructureError(DataFormatError):
    """A sentence's heads do not form one rooted tree (cycle, several roots, bad head)."""

    code = "tree-structure"


class AutobatchError(BatchcraftError, RuntimeError):
    """Auto-batching could not run the program as written."""

    code = "autobatch"


class UnsupportedOperationError(AutobatchError):
    """An operation cannot be used on lazy values (e.g. an in-place update)."""

    code = "unsupported-operation"


class InstanceError(AutobatchError):
    """Instance code raised; ``instance`` is its index in the input sequence.

    ``completed``: where an ``autobatch`` call raised it, the results of the instances before
    that one (they ran to their end, as in eager's loop), or None where they could not be
    computed (the error then has a note saying so).
    """

    code = "instance-error"
    completed: list | None = None
    failed_node: int | None = None  # (internal: the recorded operation of batched work that failed)

    def __init__(self, instance: int, message: str, *, hint: str | None = None):
        super().__init__(f"instance {instance}: {message}", hint=hint)
        self.instance = instance


class StepLimitError(AutobatchError):
    """A fiber exceeded the optional step limit (it may never finish)."""

    code = "step-limit"


class WorkspaceError(BatchcraftError, ValueError):
    """A workspace budget is malformed or cannot be met by any algorithm."""

    code = "workspace"


class MeasurementCacheError(BatchcraftError, RuntimeError):
    """The measurement cache cannot be used."""

    code = "measurement-cache"


class ConfigurationError(BatchcraftError, ValueError):
    """A configuration (threads, instances, batch size, ...) is invalid for this machine."""

    code = "configuration"


class WorkerError(BatchcraftError, RuntimeError):
    """A launched instance (worker process) died or failed; the message has its exit code and stderr."""

    code = "worker"
