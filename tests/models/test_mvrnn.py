"""MV-RNN per instance: auto-batched equals eager on real UD trees and on random tree shapes."""

from __future__ import annotations

import pytest
import torch

from batchcraft.models.mvrnn import MVRNN

from _suite_helpers import shortest, vocab_size
from equivalence import assert_matches_eager, make_tree, random_tree


@pytest.fixture
def mvrnn(ud_sentences):
    torch.manual_seed(0)
    return MVRNN(vocab_size(ud_sentences), hidden=8)


@pytest.mark.parametrize("batch,scheduler", [(1, "depth"), (8, "depth"), (8, "agenda"), (64, "agenda")])
def test_matches_eager_on_real_trees(mvrnn, ud_sentences, batch, scheduler):
    sents = shortest(ud_sentences, 64)[:batch]
    f = assert_matches_eager(mvrnn, sents, list(mvrnn.parameters()), scheduler=scheduler)
    assert f.stats.fallbacks == 0
    if batch == 64:
        assert f.stats.mean_batch > 4


def test_random_shapes_chain_fanout_single(mvrnn):
    trees = [make_tree([-1]), make_tree([-1] + list(range(0, 24))), make_tree([-1] + [0] * 20)]
    trees += [random_tree(n, seed=n) for n in (2, 5, 11)]
    assert_matches_eager(mvrnn, trees, list(mvrnn.parameters()))


def test_single_word_is_its_own_vector_and_order_matters(mvrnn):
    one = make_tree([-1])
    torch.testing.assert_close(mvrnn(one), mvrnn.leaf.vector.weight[one.word_ids[0]])
    left, right = make_tree([-1, 0]), make_tree([1, -1])  # same two words, head first vs. last
    right.word_ids = left.word_ids[::-1]
    assert not torch.allclose(mvrnn(left), mvrnn(right))  # composition is order-sensitive (eq. 2)
