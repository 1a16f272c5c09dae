"""Machine facts and where measured choices persist (measure/machine.py)."""

from __future__ import annotations

from pathlib import Path

from batchcraft.measure.machine import cache_dir


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # (hostile pass, stop 44: an empty variable put kernels.sqlite and programs/ in the working directory)
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("BATCHCRAFT_CACHE_DIR")
        else:
            monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", unset)
        assert cache_dir() == tmp_path / "xdg" / "batchcraft"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "batchcraft"
