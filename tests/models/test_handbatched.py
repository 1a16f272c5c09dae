"""Hand-batched references (packed BiLSTM, level-by-level TreeLSTM) equal the per-instance models."""

from __future__ import annotations

import pytest
import torch

from batchcraft.models.birnn import BiRNNTagger
from batchcraft.models.handbatched import birnn_padded, treelstm_levels
from batchcraft.models.treelstm import TreeLSTM

from _suite_helpers import vocab_size
from equivalence import make_tree, random_tree


def _assert_same_values_and_gradients(model, hand, ref):
    params = list(model.parameters())
    for h, r in zip(hand, ref):
        torch.testing.assert_close(h, r, atol=1e-5, rtol=1e-5)
    weights = [torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(ref)]
    g_hand = torch.autograd.grad(sum((h * w).sum() for h, w in zip(hand, weights)), params, allow_unused=True)
    g_ref = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), params, allow_unused=True)
    for p, a, b in zip(params, g_hand, g_ref):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        assert (a - b).abs().max() <= 1e-4 * b.abs().max().clamp_min(1e-6), f"gradient of {tuple(p.shape)}"


@pytest.fixture
def tagger(ud_sentences):
    torch.manual_seed(0)
    return BiRNNTagger(vocab_size(ud_sentences), hidden=12, word_dim=10)


@pytest.fixture
def treelstm(ud_sentences):
    torch.manual_seed(0)
    return TreeLSTM(vocab_size(ud_sentences), hidden=16, word_dim=12, tag_dim=6)


def test_treelstm_levels_equals_eager_on_real_trees(treelstm, ud_sentences):
    sents = ud_sentences[:32]
    _assert_same_values_and_gradients(treelstm, treelstm_levels(treelstm, sents), [treelstm(s) for s in sents])


def test_treelstm_levels_on_chain_fanout_single_and_random_trees():
    torch.manual_seed(1)
    model = TreeLSTM(50, hidden=8, word_dim=6, tag_dim=4)
    trees = [make_tree([-1]), make_tree([-1] + list(range(0, 30))), make_tree([-1] + [0] * 25)]
    trees += [random_tree(n, seed=n) for n in (2, 7, 19)]
    _assert_same_values_and_gradients(model, treelstm_levels(model, trees), [model(t) for t in trees])
    assert treelstm_levels(model, []) == []


def test_birnn_padded_equals_eager(tagger, ud_sentences):
    sents = ud_sentences[:24]  # mixed lengths: packing and unpacking must keep each sentence's rows
    _assert_same_values_and_gradients(tagger, birnn_padded(tagger, sents), [tagger(s) for s in sents])
    assert birnn_padded(tagger, []) == []


def test_birnn_padded_shares_the_tagger_parameters(tagger, ud_sentences):
    names = [n for n, _ in tagger.named_parameters()]
    before = birnn_padded(tagger, ud_sentences[:2])[0]
    with torch.no_grad():
        tagger.bwd.bias_hh.add_(0.5)  # a change to the cell must show in the packed LSTM
    after = birnn_padded(tagger, ud_sentences[:2])[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, tagger(ud_sentences[0]))
    assert [n for n, _ in tagger.named_parameters()] == names  # the reference adds no parameters


def test_birnn_padded_follows_replaced_parameters(tagger, ud_sentences):
    birnn_padded(tagger, ud_sentences[:2])
    tagger.fwd.weight_ih = torch.nn.Parameter(torch.randn_like(tagger.fwd.weight_ih))
    torch.testing.assert_close(birnn_padded(tagger, ud_sentences[:2])[0], tagger(ud_sentences[0]))
