"""NestedRNN per instance: character GRU inside a word LSTM; auto-batched equals eager."""

from __future__ import annotations

import pytest
import torch

from batchcraft.models.nestedrnn import NestedRNN

from _suite_helpers import shortest
from equivalence import assert_matches_eager, random_tree


@pytest.fixture
def nested(ud_sentences):
    torch.manual_seed(0)
    return NestedRNN("".join(w for s in ud_sentences[:40] for w in s.words), hidden=12, char_dim=8)


@pytest.mark.parametrize("batch,scheduler", [(1, "depth"), (8, "depth"), (8, "agenda")])
def test_matches_eager_on_real_sentences(nested, ud_sentences, batch, scheduler):
    sents = shortest(ud_sentences, 32)[:batch]
    f = assert_matches_eager(nested, sents, list(nested.parameters()), scheduler=scheduler)
    assert f.stats.fallbacks == 0
    if batch == 8:
        assert f.stats.mean_batch > 4  # the c-th characters of all words run together


def test_unknown_characters_map_to_id_zero(nested, ud_sentences):
    s = ud_sentences[0]
    assert "\u2603" not in nested.char_ids
    h = nested.word("\u2603")  # a character never seen: the unknown row, not an error
    torch.testing.assert_close(h, nested.char_rnn(nested.char_embed.weight[0], torch.zeros(12)))
    assert nested(s).shape == (12,)


def test_matches_eager_on_random_sentences_including_one_word(nested):
    sents = [random_tree(n, seed=n) for n in (1, 2, 5, 9)]  # words "w0", "w1", ...: 2-3 characters
    assert_matches_eager(nested, sents, list(nested.parameters()))
