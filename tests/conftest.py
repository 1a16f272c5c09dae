"""Shared fixtures. Helpers live in tests/equivalence.py (``from equivalence import ...``)."""

from __future__ import annotations

import pytest

from batchcraft.data import Vocab, encode, load_sentences
from equivalence import assert_matches_eager, make_tree, random_tree  # noqa: F401  (re-exported)


@pytest.fixture(scope="session")
def ud_sentences():
    """The first 80 sentences of the embedded UD English EWT dev split, encoded."""
    sents = load_sentences(limit=80)
    encode(sents, Vocab.from_sentences(sents))
    return sents
