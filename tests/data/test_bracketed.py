"""Bracketed constituency trees: parsing and hostile files (always file:line, never a hang)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from batchcraft.data import read_bracketed
from batchcraft.errors import DataFormatError

GOOD = "(S (NP (DT The) (NN cat))\n   (VP (VBD sat)))\n(ROOT (X hi))\n( (Y empty-label))\n"


def write(tmp_path, data, name="t.mrg"):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def test_parses_trees_across_lines(tmp_path):
    trees = list(read_bracketed(write(tmp_path, GOOD)))
    assert [t.label for t in trees] == ["S", "ROOT", ""]
    assert trees[0].leaves() == ["The", "cat", "sat"] and trees[0].depth() == 3
    assert trees[0].children[1].line == 2 and trees[1].line == 3


@pytest.mark.parametrize("text,line,msg", [
    ("(S (NP (DT The)\n (NN cat)", 1, "never closed"),
    ("(S (X a)))\n", 1, r"unbalanced '\)'"),
    ("word (S (X a))", 1, "outside any tree"),
    ("(S (X a b))", 1, "two words"),
    ("(S (X a) b)", 1, "after children"),
    ("(S\n(X a (Y b)))", 2, "has a word and children"),
])
def test_malformed_files_name_the_line(tmp_path, text, line, msg):
    with pytest.raises(DataFormatError, match=msg) as ei:
        list(read_bracketed(write(tmp_path, text)))
    assert ei.value.line == line and f"t.mrg:{line}" in str(ei.value)


def test_bad_utf8(tmp_path):
    with pytest.raises(DataFormatError, match=r"t.mrg:2: invalid UTF-8"):
        list(read_bracketed(write(tmp_path, b"(S (X a))\n(S (X \xff))")))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_edits=st.integers(1, 6))
def test_random_mutations_give_trees_or_a_located_error(tmp_path_factory, seed, n_edits):
    rng = random.Random(seed)
    data = bytearray(GOOD.encode() * 2)
    for _ in range(n_edits):
        op = rng.randrange(3)
        i = rng.randrange(len(data) + 1)
        if op == 0 and data:
            del data[min(i, len(data) - 1)]
        elif op == 1:
            data[i:i] = bytes([rng.choice(b"() \n\txy\xff")])
        else:
            data = data[:i]  # truncation
    p = write(tmp_path_factory.mktemp("m"), bytes(data))
    n_lines = bytes(data).count(b"\n") + 1
    try:
        trees = list(read_bracketed(p))
        assert all(t.label is not None for t in trees)
    except DataFormatError as exc:
        assert exc.line is not None and 1 <= exc.line <= n_lines, str(exc)
