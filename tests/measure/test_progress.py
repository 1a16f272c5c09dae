"""Progress bars appear only on a terminal (logs and pipes stay readable)."""

import io
import sys

from batchcraft.measure.progress import progress_bar, progress_enabled


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_hidden_when_stderr_is_a_pipe(monkeypatch):
    monkeypatch.delenv("BATCHCRAFT_PROGRESS", raising=False)
    err = _Stream(tty=False)
    monkeypatch.setattr(sys, "stderr", err)
    assert not progress_enabled()
    assert list(progress_bar(range(50), desc="x")) == list(range(50))
    assert err.getvalue() == ""


def test_shown_on_a_terminal_and_env_overrides(monkeypatch):
    monkeypatch.delenv("BATCHCRAFT_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", _Stream(tty=True))
    assert progress_enabled() and not progress_enabled(False)
    monkeypatch.setenv("BATCHCRAFT_PROGRESS", "0")
    assert not progress_enabled()
    monkeypatch.setattr(sys, "stderr", _Stream(tty=False))
    monkeypatch.setenv("BATCHCRAFT_PROGRESS", "1")
    assert progress_enabled()
