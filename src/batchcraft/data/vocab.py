"""Vocabularies mapping words and UPOS tags to embedding ids."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from batchcraft.data.conllu_trees import Sentence

#: The 17 Universal POS tags (UD v2), in the guidelines' order.
UPOS_TAGS = ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART",
             "PRON", "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X")


class Vocab:
    """String-to-id table with id 0 reserved for unknown items.

    Args:
        items (Iterable[str]): items in id order (ids start at 1).
    """

    UNK = 0

    def __init__(self, items: Iterable[str]):
        self.itos = ["<unk>"]
        self.stoi: dict[str, int] = {}
        for it in items:
            if it not in self.stoi:
                self.stoi[it] = len(self.itos)
                self.itos.append(it)

    @classmethod
    def from_sentences(cls, sentences: Iterable[Sentence], *, min_count: int = 1,
                       lowercase: bool = True) -> "Vocab":
        """Words seen at least ``min_count`` times, most frequent first."""
        counts = Counter(w.lower() if lowercase else w for s in sentences for w in s.words)
        v = cls(w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_count)
        v.lowercase = lowercase
        return v

    lowercase = False

    def __len__(self) -> int:
        return len(self.itos)

    def __getitem__(self, item: str) -> int:
        return self.stoi.get(item.lower() if self.lowercase else item, self.UNK)


def encode(sentences: Iterable[Sentence], words: Vocab, tags: Vocab | None = None) -> None:
    """Fill ``word_ids`` and ``upos_ids`` of each sentence in place."""
    tags = tags or Vocab(UPOS_TAGS)
    for s in sentences:
        s.word_ids = [words[w] for w in s.words]
        s.upos_ids = [tags[t] for t in s.upos]
