"""Compiled lowered programs kept across processes.

:mod:`lower` emits each batched program as Python source and compiles it; compiling costs a first
auto-batched call 0.2-1.4 ms a program (3.3 ms of a TreeLSTM's first call here, six programs). As
CPython keeps ``.pyc`` files, the code object of each source is marshalled under the cache
directory (:func:`batchcraft.measure.cache_dir`, ``programs/``), named by a hash of the source, the
file name it is compiled under and the interpreter's bytecode magic number, so a new process loads
it instead (about 50 µs).

Each file holds the magic number, a BLAKE2b digest of the marshalled code keyed by the file's own
name (so another program's file copied under this name does not load) and the code. A file
that does not load (truncated, damaged, another interpreter's, not a code object of that name) is
compiled again and rewritten: a damaged byte must not reach ``marshal`` (which may crash on
bytecode that is wrong but well-formed). A directory that cannot be written only costs the compile. Files are
written whole under a temporary name, then renamed, so concurrent processes never read half a file.
At most :data:`MAX_FILES` are kept (the oldest go first). ``BATCHCRAFT_CODE_CACHE=0`` turns the
cache off. The files are trusted as ``.pyc`` files are: the cache directory is the user's own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import tempfile
import types

from batchcraft.measure.machine import cache_dir

#: files kept in the cache (a program's file is 1-10 KB)
MAX_FILES = 4096

_MAGIC = importlib.util.MAGIC_NUMBER
_DIGEST = 16  # bytes of the BLAKE2b digest of the marshalled code that follows the magic number
_dirs: dict = {}  # cache directory path -> its programs/ directory, or None where it cannot be made


def _directory():
    if os.environ.get("BATCHCRAFT_CODE_CACHE", "1") == "0":
        return None
    root = str(cache_dir())
    if root not in _dirs:
        d = os.path.join(root, "programs")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            d = None
        _dirs[root] = d
    return _dirs[root]


def compile_program(source: str, filename: str) -> types.CodeType:
    """``compile(source, filename, "exec")``, loaded from the cache where an earlier process
    compiled the same source under the same name with the same interpreter.

    Args:
        source (str): the module source (a ``def run(...)`` of :mod:`lower`).
        filename (str): the name tracebacks show (``<batchcraft program NAME>``).
    Returns:
        the code object, equal to what ``compile`` returns.
    Raises:
        SyntaxError: as ``compile`` (a source that does not compile is never cached).
    """
    d = _directory()
    if d is None:
        return compile(source, filename, "exec")
    digest = hashlib.sha256(b"%s\0%s\0%s" % (_MAGIC, filename.encode(), source.encode())).hexdigest()[:40]
    path = os.path.join(d, digest + ".code")
    code = _load(path, filename, digest)
    if code is None:
        code = compile(source, filename, "exec")
        _store(d, path, code, digest)
    return code


def _seal(key: str, body: bytes) -> bytes:
    """The digest a file stores: of its own source key and its marshalled code, so a file copied
    or renamed to another program's name does not load (a hostile pass, stop 44)."""
    return hashlib.blake2b(body, digest_size=_DIGEST, key=key.encode()[:64]).digest()


def _load(path: str, filename: str, key: str):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(_MAGIC) + _DIGEST
    if not data.startswith(_MAGIC) or len(data) <= head:
        return None
    body = data[head:]
    if _seal(key, body) != data[len(_MAGIC):head]:
        return None
    try:
        code = marshal.loads(body)
    except Exception:  # noqa: BLE001 (marshal raises EOFError, ValueError, TypeError, SystemError...)
        return None
    if type(code) is not types.CodeType or code.co_filename != filename:
        return None
    return code


def _store(d: str, path: str, code, key: str) -> None:
    try:
        if len(os.listdir(d)) >= MAX_FILES:
            _prune(d)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        try:
            body = marshal.dumps(code)
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + _seal(key, body) + body)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        pass  # a read-only or full cache directory: the program was compiled all the same


def _prune(d: str) -> None:
    """Drop the older half of the cached programs (by modification time)."""
    entries = []
    for name in os.listdir(d):
        p = os.path.join(d, name)
        try:
            entries.append((os.stat(p).st_mtime, p))
        except OSError:
            pass
    entries.sort()
    for _, p in entries[: len(entries) // 2 + 1]:
        try:
            os.unlink(p)
        except OSError:
            pass


__all__ = ["compile_program", "MAX_FILES"]
