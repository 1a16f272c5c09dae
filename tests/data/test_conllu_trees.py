"""CoNLL-U loading: real data, multiword tokens, empty nodes, and malformed files."""

from __future__ import annotations

import pytest

from batchcraft.data import Vocab, default_path, encode, load_sentences, read_conllu
from batchcraft.errors import DataFormatError, TreeStructureError

GOOD = """# sent_id = a
# text = I don't know.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\t_
4.1\tit\t_\tPRON\t_\t_\t_\t_\t4:obj\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

"""


def write(tmp_path, text, name="x.conllu"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_embedded_dev_split_loads_as_trees():
    sents = load_sentences()
    assert len(sents) == 2001  # UD EWT v2.16 dev
    assert sum(len(s) for s in sents) == 25147  # syntactic words, as in shared/data/README.md
    assert max(s.depth() for s in sents) == 11
    s = sents[0]
    assert s.words[:3] == ["From", "the", "AP"] and s.root == 3
    assert s.children[3] == [2, 5, 6]
    assert (default_path().parent / "LICENSE.txt").exists()


def test_multiword_ranges_and_empty_nodes_are_skipped(tmp_path):
    [s] = list(read_conllu(write(tmp_path, GOOD)))
    assert s.words == ["I", "do", "n't", "know", "."]
    assert s.heads == [3, 3, 3, -1, 3] and s.root == 3 and s.children[3] == [0, 1, 2, 4]
    assert s.sent_id == "a" and s.source.endswith("x.conllu:1")


def test_vocab_and_encoding():
    sents = load_sentences(limit=5)
    v = Vocab.from_sentences(sents)
    encode(sents, v)
    assert all(len(s.word_ids) == len(s) for s in sents)
    assert v["the"] == v["The"] and v["no-such-word-xyz"] == 0
    assert all(0 < t < 18 for s in sents for t in s.upos_ids)


@pytest.mark.parametrize("bad,line,msg", [
    (GOOD.replace("1\tI\tI\tPRON", "1\tI\tPRON", 1), 3, "10 tab-separated columns"),
    (GOOD.replace("\t4\taux", "\tX\taux"), 5, "bad HEAD"),
    (GOOD.replace("5\t.\t.", "x\t.\t."), 9, "bad word ID"),
    (GOOD.replace("\t4\tnsubj", "\t9\tnsubj"), 3, "outside 0..5"),
])
def test_malformed_lines_name_file_and_line(tmp_path, bad, line, msg):
    p = write(tmp_path, "# first\n1\tA\ta\tX\tX\t_\t0\troot\t_\t_\n\n" + bad)
    with pytest.raises(DataFormatError, match=msg) as ei:
        list(read_conllu(p))
    assert ei.value.line == line + 3 and f"x.conllu:{line + 3}" in str(ei.value)


def test_cycle_and_multiple_roots_are_reported(tmp_path):
    cyc = "1\ta\ta\tX\tX\t_\t2\tdep\t_\t_\n2\tb\tb\tX\tX\t_\t1\tdep\t_\t_\n3\tc\tc\tX\tX\t_\t0\troot\t_\t_\n\n"
    with pytest.raises(TreeStructureError, match="cycle"):
        list(read_conllu(write(tmp_path, cyc)))
    two = "1\ta\ta\tX\tX\t_\t0\troot\t_\t_\n2\tb\tb\tX\tX\t_\t0\troot\t_\t_\n\n"
    with pytest.raises(TreeStructureError, match="2 roots"):
        list(read_conllu(write(tmp_path, two)))
    with pytest.warns(UserWarning, match="skipped sentence"):
        kept = list(read_conllu(write(tmp_path, two + GOOD), on_bad_tree="skip"))
    assert len(kept) == 1


def test_bad_utf8_and_missing_file(tmp_path):
    p = tmp_path / "b.conllu"
    p.write_bytes(GOOD.encode() + b"1\t\xff\tx\tX\tX\t_\t0\troot\t_\t_\n")
    with pytest.raises(DataFormatError, match="b.conllu:11: invalid UTF-8"):
        list(read_conllu(p))
    with pytest.raises(DataFormatError, match="cannot read"):
        list(read_conllu(tmp_path / "missing.conllu"))
