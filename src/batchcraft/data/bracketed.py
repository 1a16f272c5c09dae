"""Reader for bracketed (Penn-Treebank-style) constituency trees.

``(S (NP (DT The) (NN cat)) (VP (VBD sat)))`` -- one or more trees per file,
free to span lines. Used for binary/n-ary TreeLSTMs over constituency trees
(e.g. the Stanford Sentiment Treebank's format). Every malformed input raises
:class:`~batchcraft.errors.DataFormatError` naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from batchcraft.data._files import read_utf8
from batchcraft.errors import DataFormatError


@dataclass
class BracketedTree:
    """A constituency tree node: a label and either children or a word (leaf).

    Attributes:
        label (str): constituent label (``NP``) or POS tag of a leaf; may be empty (``( ...)``).
        children (list[BracketedTree]): sub-constituents; empty for a leaf.
        word (str | None): the token of a leaf.
        line (int): line of the opening parenthesis.
    """

    label: str
    children: list = field(default_factory=list)
    word: str | None = None
    line: int = 0

    def leaves(self) -> list[str]:
        if self.word is not None:
            return [self.word]
        return [w for c in self.children for w in c.leaves()]

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)


def _tokens(path: Path, text: str) -> Iterator[tuple[str, int]]:
    line = 1
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
            i += 1
        elif ch in " \t\r":
            i += 1
        elif ch in "()":
            yield ch, line
            i += 1
        else:
            j = i
            while j < n and text[j] not in " \t\r\n()":
                j += 1
            yield text[i:j], line
            i = j


def read_bracketed(path: str | Path) -> Iterator[BracketedTree]:
    """Yield the trees of a bracketed-tree file.

    Raises:
        DataFormatError: unreadable file, bad UTF-8, unbalanced parentheses, a word outside
            any tree, or a node with both a word and children (message ``file:line: ...``).
    """
    path = Path(path)
    text = read_utf8(path)
    stack: list[BracketedTree] = []
    expect_label = False
    for tok, line in _tokens(path, text):
        if tok == "(":
            node = BracketedTree(label="", line=line)
            if stack:
                top = stack[-1]
                if top.word is not None:
                    raise DataFormatError(path, line, f"node {top.label!r} (line {top.line}) has a word "
                                                      f"and children")
                top.children.append(node)
            stack.append(node)
            expect_label = True
        elif tok == ")":
            if not stack:
                raise DataFormatError(path, line, "unbalanced ')': no open tree")
            node = stack.pop()
            expect_label = False
            if node.word is None and not node.children and node.label and not stack:
                raise DataFormatError(path, line, f"tree {node.label!r} is empty")
            if not stack:
                yield node
        else:
            if not stack:
                raise DataFormatError(path, line, f"word {tok!r} outside any tree")
            top = stack[-1]
            if expect_label:
                top.label = tok
                expect_label = False
            elif top.children:
                raise DataFormatError(path, line, f"word {tok!r} after children in node {top.label!r}")
            elif top.word is not None:
                raise DataFormatError(path, line, f"node {top.label!r} has two words "
                                                  f"({top.word!r}, {tok!r})")
            else:
                top.word = tok
    if stack:
        raise DataFormatError(path, stack[-1].line, f"unbalanced '(': tree opened here is never closed",
                              hint="the file may be truncated")
