"""BiRNN tagger per instance: auto-batched equals eager (hand-batched: test_handbatched.py)."""

from __future__ import annotations

import pytest
import torch

from batchcraft.models.birnn import BiRNNTagger

from _suite_helpers import shortest, vocab_size
from equivalence import assert_matches_eager, random_tree


@pytest.fixture
def tagger(ud_sentences):
    torch.manual_seed(0)
    return BiRNNTagger(vocab_size(ud_sentences), hidden=12, word_dim=10)


@pytest.mark.parametrize("batch,scheduler", [(1, "depth"), (8, "depth"), (8, "agenda"), (64, "depth")])
def test_matches_eager_on_real_sentences(tagger, ud_sentences, batch, scheduler):
    sents = shortest(ud_sentences, 64)[:batch]
    f = assert_matches_eager(tagger, sents, list(tagger.parameters()), scheduler=scheduler)
    assert f.stats.fallbacks == 0
    if batch == 64:
        assert f.stats.mean_batch > 4


def test_one_logit_row_per_word(tagger, ud_sentences):
    s = ud_sentences[3]
    assert tagger(s).shape == (len(s), 18)


def test_matches_eager_on_random_sentences_including_one_word(tagger):
    sents = [random_tree(n, seed=n) for n in (1, 2, 5, 9, 17)]
    assert_matches_eager(tagger, sents, list(tagger.parameters()))
