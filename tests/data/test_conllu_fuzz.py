"""Fuzzing the CoNLL-U reader: malformed files give DataFormatError naming file and line, never
another exception, a hang, or a sentence that is not one rooted tree.

Inputs are real UD English EWT sentences (the embedded dev split) damaged by hypothesis:
truncation, random byte mutations (flips, deletions, insertions, bad UTF-8), line shuffles and
duplicates, random HEADs (cycles, several roots, out of range), random IDs and column counts.
Every outcome must be one of: a list of valid trees, or ``DataFormatError`` (incl.
``TreeStructureError``) whose ``path`` is the file and whose ``line`` is a line of it.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from batchcraft.data import default_path, read_conllu
from batchcraft.errors import DataFormatError, TreeStructureError

LONG = os.environ.get("BATCHCRAFT_FUZZ_PROFILE", "fast") == "long"
N = 4000 if LONG else 400
SETTINGS = settings(max_examples=N, deadline=None, database=None, derandomize=not LONG,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _real_sentences(k: int = 40) -> list[bytes]:
    text = default_path().read_bytes().decode("utf-8")
    blocks = [b for b in text.split("\n\n") if b.strip()]
    return [(b.strip("\n") + "\n\n").encode("utf-8") for b in blocks[:k]]


SENTENCES = _real_sentences()
_DIR = Path(tempfile.mkdtemp(prefix="conllu-fuzz-"))
_TIMEOUT_S = 5


@contextmanager
def no_hang(seconds: int = _TIMEOUT_S):
    """Fail (instead of hanging) if the reader runs longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"read_conllu ran longer than {seconds} s (a hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# Bugs still open in /work/notes/autobatch-bugs.md; inputs that hit them are left out of the
# fuzzing (each has its own xfail regression test). Remove a number once the bug is fixed.
OPEN_BUGS: set = set()  # #7 and #8 fixed (ASCII digits only; lines split at \n)
_SPLITLINES_EXTRA = re.compile("[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _hits_open_bug(data: bytes) -> bool:
    text = data.decode("utf-8", errors="replace")
    if 7 in OPEN_BUGS:
        for line in text.split("\n"):
            cols = line.split("\t")
            if any(not c.isascii() and any(ch.isdigit() for ch in c) for c in cols[:1] + cols[6:7]):
                return True
    return 8 in OPEN_BUGS and bool(_SPLITLINES_EXTRA.search(text))


def check_file(data: bytes, on_bad_tree: str = "raise") -> str:
    """Read ``data`` as a .conllu file; assert the contract; return "ok" or the error's code."""
    assume(not _hits_open_bug(data))
    path = _DIR / "fuzz.conllu"
    path.write_bytes(data)
    n_lines = data.count(b"\n") + 1
    try:
        with no_hang():
            sentences = list(read_conllu(path, on_bad_tree=on_bad_tree))
    except DataFormatError as exc:
        assert exc.path == str(path)
        assert exc.line is not None and 1 <= exc.line <= n_lines, f"line {exc.line} of {n_lines}"
        assert str(exc).startswith(f"{path}:{exc.line}: ")
        return exc.code
    for s in sentences:  # accepted sentences are single rooted trees
        n = len(s)
        assert n >= 1 and len(s.heads) == len(s.upos) == len(s.deprels) == len(s.children) == n
        assert [i for i, h in enumerate(s.heads) if h == -1] == [s.root]
        assert all(-1 <= h < n for h in s.heads)
        reaches = {s.root}  # every word reaches the root (memoised walk: linear time)
        for i in range(n):
            path, v = [], i
            while v not in reaches:
                path.append(v)
                v = s.heads[v]
                assert len(path) <= n, f"cycle through word {i + 1}"
            reaches.update(path)
        assert sorted(c for cs in s.children for c in cs) == sorted(set(range(n)) - {s.root})
    return "ok"


# ---------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------
def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


@st.composite
def damaged_files(draw):
    k = draw(st.integers(1, 4))
    start = draw(st.integers(0, len(SENTENCES) - k))
    data = b"".join(SENTENCES[start:start + k])
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(("truncate", "flip", "delete", "insert", "bad_utf8", "dup_line",
                                    "drop_line", "swap_lines", "head", "id", "columns", "blank")))
        if not data:
            break
        if how == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif how == "flip":
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
        elif how == "delete":
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + data[i + draw(st.integers(1, 20)):]
        elif how == "insert":
            i = draw(st.integers(0, len(data)))
            data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
        elif how == "bad_utf8":
            i = draw(st.integers(0, len(data)))
            data = data[:i] + draw(st.sampled_from((b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf"))) + data[i:]
        else:
            lines = _lines(data)
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if how == "dup_line":
                lines.insert(j, lines[i])
            elif how == "drop_line":
                del lines[i]
            elif how == "swap_lines":
                lines[i], lines[j] = lines[j], lines[i]
            elif how == "blank":
                lines.insert(i, draw(st.sampled_from((b"", b"   ", b"\t", b"#"))))
            else:
                cols = lines[i].split(b"\t")
                if how == "columns":
                    n = draw(st.integers(0, 12))
                    cols = (cols + [b"_"] * 12)[:n]
                elif len(cols) == 10 and how == "head":
                    cols[6] = draw(st.sampled_from((b"0", b"1", b"2", b"3", b"-1", b"99", b"_", b"x", b"1.5",
                                                    str(j).encode())))
                elif len(cols) == 10 and how == "id":
                    cols[0] = draw(st.sampled_from((b"0", b"1", b"7", b"3-2", b"2-", b"1.1", b"-", b"01",
                                                    b"", str(j).encode(), b"\xc2\xb2", b"1e3")))
                lines[i] = b"\t".join(cols)
            data = b"\n".join(lines)
    return data


@SETTINGS
@given(data=damaged_files())
def test_damaged_real_sentences_give_data_format_errors_or_valid_trees(data):
    check_file(data)


@SETTINGS
@given(data=damaged_files())
def test_skip_mode_never_raises_tree_errors(data):
    import warnings

    assume(not _hits_open_bug(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = _DIR / "skip.conllu"
        path.write_bytes(data)
        try:
            with no_hang():
                list(read_conllu(path, on_bad_tree="skip"))
        except TreeStructureError as exc:  # pragma: no cover - the assertion below reports it
            pytest.fail(f"on_bad_tree='skip' raised {exc}")
        except DataFormatError as exc:
            assert exc.line is not None


@settings(max_examples=N // 2, deadline=None, database=None, derandomize=not LONG)
@given(data=st.binary(max_size=400))
def test_random_bytes(data):
    check_file(data)


@settings(max_examples=N // 2, deadline=None, database=None, derandomize=not LONG)
@given(heads=st.lists(st.integers(-1, 12), min_size=1, max_size=12))
def test_random_heads_cycles_and_roots(heads):
    lines = [f"{i}\tw{i}\tw\tX\tX\t_\t{h}\tdep\t_\t_" for i, h in enumerate(heads, 1)]
    data = ("# sent_id = r\n" + "\n".join(lines) + "\n\n").encode()
    code = check_file(data)
    n = len(heads)
    ok = sum(h == 0 for h in heads) == 1 and all(0 <= h <= n for h in heads)
    if ok:  # a forest check by hand: every word reaches the root
        for i in range(1, n + 1):
            seen, v = 0, i
            while v != 0 and seen <= n:
                v, seen = heads[v - 1], seen + 1
            ok = ok and v == 0
    assert (code == "ok") == ok, (heads, code)
    if not ok and all(h >= 0 for h in heads):
        assert code == "tree-structure"


def test_huge_sentence_and_long_chain_do_not_hang():
    n = 20_000  # a chain: word i's head is word i+1
    lines = [f"{i}\tw\tw\tX\tX\t_\t{(i + 1) if i < n else 0}\tdep\t_\t_" for i in range(1, n + 1)]
    assert check_file(("\n".join(lines) + "\n\n").encode()) == "ok"
    lines[-1] = lines[-1].replace("\t0\t", "\t1\t")  # now one big cycle
    assert check_file(("\n".join(lines) + "\n\n").encode()) == "tree-structure"


def test_embedded_file_truncated_at_every_line_of_a_sentence():
    data = b"".join(SENTENCES[:3])
    cut_points = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    codes = {check_file(data[:c]) for c in cut_points}
    codes |= {check_file(data[:c - 3]) for c in cut_points if c > 3}  # mid-line cuts
    assert "ok" in codes and "data-format" in codes


def test_bug7_unicode_digit_id_is_a_data_format_error():
    data = "1\tA\ta\tX\tX\t_\t0\troot\t_\t_\n\u00b2\tB\tb\tX\tX\t_\t1\tdep\t_\t_\n\n".encode()
    with pytest.raises(DataFormatError, match=r":2: bad word ID"):
        list(read_conllu(_write(data)))


def test_bug8_line_numbers_count_only_newlines():
    data = "# a\x0c# b\n1\tA\ta\tX\tX\t_\tX\troot\t_\t_\n\n".encode()
    with pytest.raises(DataFormatError) as ei:
        list(read_conllu(_write(data)))
    assert ei.value.line == 2
    ok = "# text = a\x0cb\u2028c\n1\tA\u2028\ta\tX\tX\t_\t0\troot\t_\t_\n\n".encode()
    assert len(list(read_conllu(_write(ok)))) == 1


def _write(data: bytes) -> Path:
    path = _DIR / "case.conllu"
    path.write_bytes(data)
    return path
