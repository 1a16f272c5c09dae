"""The cache of compiled lowered programs (codecache.py): loaded in a new process, never wrong."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys

import pytest

from batchcraft.autobatching import codecache

SRC = "def run(n, I0):\n    return [I0 * n]\n"
NAME = "<batchcraft program Test>"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHCRAFT_CODE_CACHE", raising=False)
    return tmp_path / "programs"


@pytest.fixture
def compiles(monkeypatch):
    seen = []
    original = builtins.compile

    def counting(src, name, mode, *a, **k):
        if name == NAME:
            seen.append(src)
        return original(src, name, mode, *a, **k)

    monkeypatch.setattr(builtins, "compile", counting)
    return seen


def _run(code):
    ns = {}
    exec(code, ns)
    return ns["run"](3, 2)


def test_a_program_compiled_once_is_loaded_after(cache, compiles):
    first = codecache.compile_program(SRC, NAME)
    assert len(compiles) == 1 and len(list(cache.iterdir())) == 1
    codecache._dirs.clear()  # as a new process
    again = codecache.compile_program(SRC, NAME)
    assert len(compiles) == 1  # loaded, not compiled
    assert again.co_filename == NAME and _run(again) == _run(first) == [6]
    codecache.compile_program(SRC, "<batchcraft program Other>")
    codecache.compile_program(SRC.replace("n]", "n + 1]"), NAME)
    assert len(compiles) == 2 and len(list(cache.iterdir())) == 3  # another name, another source


@pytest.mark.parametrize("damage", ["truncated", "empty", "other magic", "one byte flipped", "not code",
                                    "not marshal", "other name"])
def test_a_file_that_does_not_load_is_compiled_again_and_rewritten(cache, compiles, damage):
    import marshal

    codecache.compile_program(SRC, NAME)
    (path,) = cache.iterdir()
    data = path.read_bytes()
    magic = codecache._MAGIC
    head = len(magic) + codecache._DIGEST

    def signed(body):
        return magic + codecache._seal(path.stem, body) + body

    flipped = bytearray(data)
    flipped[head + 20] ^= 0x40  # one byte of the bytecode or its constants
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                      "other magic": b"\0\0\0\0" + data[len(magic):],
                      "one byte flipped": bytes(flipped),
                      "not code": signed(marshal.dumps([1, 2])),
                      "not marshal": signed(b"\xff\x00garbage"),
                      "other name": signed(marshal.dumps(compile(SRC, "<elsewhere>", "exec")))}[damage])
    codecache._dirs.clear()
    code = codecache.compile_program(SRC, NAME)
    assert _run(code) == [6] and code.co_filename == NAME and len(compiles) == 2
    assert path.read_bytes() == data  # rewritten whole


def test_the_cache_can_be_off_or_unwritable(cache, compiles, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHCRAFT_CODE_CACHE", "0")
    assert _run(codecache.compile_program(SRC, NAME)) == [6]
    assert not cache.exists()
    monkeypatch.delenv("BATCHCRAFT_CODE_CACHE")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(blocked))  # programs/ cannot be made under it
    assert _run(codecache.compile_program(SRC, NAME)) == [6]
    if os.geteuid() != 0:  # (root writes anywhere)
        monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(tmp_path / "ro"))
        (tmp_path / "ro" / "programs").mkdir(parents=True)
        (tmp_path / "ro" / "programs").chmod(0o500)
        assert _run(codecache.compile_program(SRC, NAME)) == [6]
    with pytest.raises(SyntaxError):
        codecache.compile_program("def run(:\n", NAME)


def test_the_oldest_programs_go_when_the_cache_is_full(cache, monkeypatch):
    monkeypatch.setattr(codecache, "MAX_FILES", 6)
    for i in range(20):
        codecache.compile_program(SRC.replace("n]", f"n + {i}]"), NAME)
        assert len(list(cache.iterdir())) <= 6
    codecache._dirs.clear()
    assert _run(codecache.compile_program(SRC.replace("n]", "n + 19]"), NAME)) == [25]  # the newest kept


_NEW_PROCESS = r"""
import builtins, sys, torch
from batchcraft import autobatch
from batchcraft.data import load_sentences
from batchcraft.models import suite

names = []
original = builtins.compile
builtins.compile = lambda src, name, *a, **k: names.append(name) or original(src, name, *a, **k)
task = suite.build("treelstm", load_sentences(limit=12), hidden=16)
with torch.no_grad():
    got = torch.stack(autobatch(task.fn)(task.instances))
    want = torch.stack([task.fn(x) for x in task.instances])
assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
print(sum(n.startswith("<batchcraft program") for n in names))
"""


def test_a_new_process_runs_the_cached_programs(tmp_path):
    env = dict(os.environ, BATCHCRAFT_CACHE_DIR=str(tmp_path))
    env.pop("BATCHCRAFT_CODE_CACHE", None)
    counts = [int(subprocess.run([sys.executable, "-c", _NEW_PROCESS], env=env, capture_output=True, text=True,
                                 timeout=300, check=True).stdout.split()[-1]) for _ in range(2)]
    assert counts[0] > 0 and counts[1] == 0, counts



def test_any_error_of_marshal_means_a_compile(cache, compiles, monkeypatch):
    # (hostile pass, stop 44: one flipped byte made marshal raise SystemError, which escaped, and every
    # later group ran one instance at a time; the digest now refuses such files before marshal)
    codecache.compile_program(SRC, NAME)
    codecache._dirs.clear()

    def broken(data):
        raise SystemError("bad argument to internal function")

    monkeypatch.setattr(codecache.marshal, "loads", broken)
    assert _run(codecache.compile_program(SRC, NAME)) == [6] and len(compiles) == 2


def test_another_programs_file_under_this_name_is_not_loaded(cache, compiles):
    # (hostile pass, stop 44: files of one block's programs rotated among their names loaded the wrong
    # code, 1,920 fallbacks a run, never rewritten)
    other = SRC.replace("n]", "n + 1]")
    codecache.compile_program(SRC, NAME)
    codecache.compile_program(other, NAME)
    a, b = sorted(cache.iterdir())
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    codecache._dirs.clear()
    assert _run(codecache.compile_program(SRC, NAME)) == [6]
    assert _run(codecache.compile_program(other, NAME)) == [7]
    assert len(compiles) == 4 and {a.read_bytes(), b.read_bytes()} == {da, db}
