"""Shared fixtures. Helpers live in tests/equivalence.py (``from equivalence import ...``)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from batchcraft.data import Vocab, encode, load_sentences
from equivalence import assert_matches_eager, make_tree, random_tree  # noqa: F401  (re-exported)


_CACHE_DIR = None


def pytest_configure(config):
    # measurements made by tests (kernel choices, micro-batching plans), often on a busy machine,
    # must not become the user's cached choices: one fresh cache directory per test session
    global _CACHE_DIR
    if "BATCHCRAFT_CACHE_DIR" not in os.environ:
        _CACHE_DIR = tempfile.mkdtemp(prefix="batchcraft-test-cache-")
        os.environ["BATCHCRAFT_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:
        os.environ.pop("BATCHCRAFT_CACHE_DIR", None)
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def ud_sentences():
    """The first 80 sentences of the embedded UD English EWT dev split, encoded."""
    sents = load_sentences(limit=80)
    encode(sents, Vocab.from_sentences(sents))
    return sents
