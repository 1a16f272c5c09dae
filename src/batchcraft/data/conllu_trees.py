"""CoNLL-U reader producing dependency trees, built on the ``conllu`` library.

Multiword-token ranges (``3-4``) and empty nodes (``5.1``) are skipped, as the
UD guidelines intend for basic trees. Every malformed line raises
:class:`~batchcraft.errors.DataFormatError` naming the file and line; a sentence
whose heads do not form one rooted tree raises
:class:`~batchcraft.errors.TreeStructureError` (or is skipped and reported
with ``on_bad_tree="skip"``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator

import conllu

from batchcraft.data._files import read_utf8
from batchcraft.errors import DataFormatError, TreeStructureError


@dataclass
class Sentence:
    """One dependency-parsed sentence: a tree with one node per syntactic word.

    Attributes:
        words (list[str]): FORM column, in order.
        upos (list[str]): UPOS column.
        heads (list[int]): 0-based index of each word's head, ``-1`` for the root.
        deprels (list[str]): DEPREL column.
        children (list[list[int]]): 0-based children of each word, in word order.
        root (int): 0-based index of the root word.
        sent_id (str | None): ``# sent_id`` comment, when present.
        source (str): ``file:line`` of the sentence's first line.
        word_ids, upos_ids (list[int]): vocabulary ids, filled by :func:`batchcraft.data.encode`.
    """

    words: list[str]
    upos: list[str]
    heads: list[int]
    deprels: list[str]
    children: list[list[int]]
    root: int
    sent_id: str | None = None
    source: str = ""
    word_ids: list[int] = field(default_factory=list)
    upos_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.words)

    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path (a one-word sentence has depth 1)."""
        best, stack = 0, [(self.root, 1)]
        while stack:
            node, d = stack.pop()
            best = max(best, d)
            stack.extend((c, d + 1) for c in self.children[node])
        return best


def default_path() -> Path:
    """Path of the embedded UD English EWT dev split."""
    return Path(str(resources.files("batchcraft.data") / "ud_english_ewt" / "en_ewt-ud-dev.conllu"))


def _blocks(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Yield (first line number, lines) for each blank-line-separated sentence block."""
    text = read_utf8(path)
    block, start = [], 0
    # CoNLL-U lines end at "\n" only (str.splitlines would also break at \x0c, U+2028, ...)
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if line.strip() == "":
            if block:
                yield start, block
            block = []
            continue
        if not block:
            start = lineno
        block.append(line)
    if block:
        yield start, block


def _is_ascii_int(s: str) -> bool:
    """Digits 0-9 only (str.isdigit also accepts '²' and other Unicode digits)."""
    return s.isascii() and s.isdigit()


def _check_token_line(path: Path, lineno: int, line: str) -> str | None:
    """Validate one token line; return its ID kind ('word', 'range', 'empty')."""
    cols = line.split("\t")
    if len(cols) != 10:
        raise DataFormatError(path, lineno, f"expected 10 tab-separated columns, found {len(cols)}",
                              hint="CoNLL-U token lines have ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC")
    tid, head = cols[0], cols[6]
    isnum = _is_ascii_int
    if "-" in tid:
        a, _, b = tid.partition("-")
        if not (isnum(a) and isnum(b)):
            raise DataFormatError(path, lineno, f"bad multiword-token range ID {tid!r}")
        return "range"
    if "." in tid:
        a, _, b = tid.partition(".")
        if not (isnum(a) and isnum(b)):
            raise DataFormatError(path, lineno, f"bad empty-node ID {tid!r}")
        return "empty"
    if not isnum(tid):
        raise DataFormatError(path, lineno, f"bad word ID {tid!r} (expected an integer)")
    if not isnum(head):
        raise DataFormatError(path, lineno, f"bad HEAD {head!r} for word {tid} (expected an integer)")
    return "word"


def _build_tree(path: Path, start: int, lines: list[str], line_of: dict[int, int]) -> Sentence:
    try:
        tokens = conllu.parse_token_and_metadata("\n".join(lines))
    except conllu.exceptions.ParseException as exc:  # conllu names no line; we do
        raise DataFormatError(path, start, f"CoNLL-U parse error in sentence: {exc}") from None
    words, upos, heads, deprels, ids = [], [], [], [], []
    for tok in tokens:
        if not isinstance(tok["id"], int):  # ranges are tuples, empty nodes too
            continue
        ids.append(tok["id"])
        words.append(tok["form"])
        upos.append(tok["upos"])
        heads.append(tok["head"])
        deprels.append(tok["deprel"])
    if not ids:
        raise DataFormatError(path, start, "sentence has no words")
    if ids != list(range(1, len(ids) + 1)):
        bad = next(i for i, v in enumerate(ids, 1) if v != i)
        raise DataFormatError(path, line_of.get(ids[bad - 1], start),
                              f"word IDs must be 1..n in order; found {ids[bad - 1]} where {bad} was expected")
    n = len(ids)
    heads0 = []
    for i, h in enumerate(heads, 1):
        if h is None or h < 0 or h > n:
            raise TreeStructureError(path, line_of[i], f"HEAD {h} of word {i} is outside 0..{n}")
        heads0.append(h - 1)
    roots = [i for i, h in enumerate(heads0) if h == -1]
    if len(roots) != 1:
        raise TreeStructureError(path, start, f"sentence has {len(roots)} roots (words "
                                 f"{[r + 1 for r in roots]}); a tree needs exactly one")
    # every word must reach the root without revisiting a word (no cycles)
    state = [0] * n  # 0 unknown, 1 on the current path, 2 reaches the root
    state[roots[0]] = 2
    for w in range(n):
        path_nodes, v = [], w
        while state[v] == 0:
            state[v] = 1
            path_nodes.append(v)
            v = heads0[v]
        if state[v] == 1:
            raise TreeStructureError(path, line_of[w + 1], f"heads form a cycle through word {v + 1}")
        for u in path_nodes:
            state[u] = 2
    children: list[list[int]] = [[] for _ in range(n)]
    for i, h in enumerate(heads0):
        if h >= 0:
            children[h].append(i)
    return Sentence(words=words, upos=upos, heads=heads0, deprels=deprels, children=children,
                    root=roots[0], sent_id=tokens.metadata.get("sent_id"), source=f"{path}:{start}")


def read_conllu(path: str | Path, *, on_bad_tree: str = "raise") -> Iterator[Sentence]:
    """Yield the sentences of a CoNLL-U file as dependency trees.

    Args:
        path (str | Path): a ``.conllu`` file.
        on_bad_tree (str): ``"raise"`` (default) or ``"skip"``; with ``"skip"`` each
            sentence whose heads do not form one rooted tree is left out with a
            ``UserWarning`` naming file and line.
    Raises:
        DataFormatError: malformed line or file (message ``file:line: ...``).
        TreeStructureError: several roots, a cycle or a head out of range.
    """
    if on_bad_tree not in ("raise", "skip"):
        raise ValueError(f"read_conllu: on_bad_tree must be 'raise' or 'skip', got {on_bad_tree!r}")
    path = Path(path)
    for start, block in _blocks(path):
        token_lines, line_of = [], {}
        for offset, line in enumerate(block):
            lineno = start + offset
            if line.startswith("#"):
                token_lines.append(line)
                continue
            kind = _check_token_line(path, lineno, line)
            if kind == "word":
                line_of[int(line.split("\t", 1)[0])] = lineno
            token_lines.append(line)
        if not line_of:
            if all(line.startswith("#") for line in block):
                continue  # comment-only block (e.g. trailing comments)
        try:
            yield _build_tree(path, start, token_lines, line_of)
        except TreeStructureError as exc:
            if on_bad_tree == "raise":
                raise
            warnings.warn(f"skipped sentence: {exc}", UserWarning, stacklevel=2)


def load_sentences(path: str | Path | None = None, *, limit: int | None = None,
                   on_bad_tree: str = "raise") -> list[Sentence]:
    """Read up to ``limit`` sentences (default: the embedded UD EWT dev split, 2,001 sentences)."""
    out = []
    for s in read_conllu(default_path() if path is None else path, on_bad_tree=on_bad_tree):
        if limit is not None and len(out) >= limit:
            break
        out.append(s)
    return out
