"""DRNN tree decoder per instance: tensor-dependent growth, auto-batched equals eager and still batches."""

from __future__ import annotations

import pytest
import torch

from batchcraft.models.drnn import DRNN, calibrate_decisions

from _suite_helpers import forward_batched_and_eager, vocab_size
from equivalence import assert_matches_eager, random_tree


@pytest.fixture(scope="module")
def drnn(ud_sentences):
    torch.manual_seed(0)
    return DRNN(vocab_size(ud_sentences), hidden=16, word_dim=12, tag_dim=6, max_nodes=12, max_depth=4)


def _depth(parents: list[int]) -> int:
    depth = [1] * len(parents)
    for i, p in enumerate(parents):  # parents come before their children
        if p >= 0:
            depth[i] = depth[p] + 1
    return max(depth)


def test_trees_differ_per_instance_and_respect_the_caps(drnn, ud_sentences):
    with torch.no_grad():
        trees = [drnn(s)["parents"] for s in ud_sentences[:64]]
    assert len({tuple(t) for t in trees}) >= 5  # the decisions really depend on the values
    assert len({len(t) for t in trees}) >= 3
    assert all(1 <= len(t) <= drnn.max_nodes and _depth(t) <= drnn.max_depth for t in trees)
    assert all(t[0] == -1 and all(0 <= p < i for i, p in enumerate(t) if i) for t in trees)


@pytest.mark.parametrize("batch,scheduler", [(1, "depth"), (8, "depth"), (8, "agenda")])
def test_matches_eager_values_gradients_and_trees(drnn, ud_sentences, batch, scheduler):
    sents = ud_sentences[:batch]
    f = assert_matches_eager(drnn, sents, list(drnn.parameters()), scheduler=scheduler)
    assert f.stats.fallbacks == 0 and f.stats.syncs > 0


@pytest.mark.parametrize("scheduler", ["depth", "agenda"])
def test_batch_64_takes_different_paths_and_still_batches(drnn, ud_sentences, scheduler):
    out, ref, f = forward_batched_and_eager(drnn, ud_sentences[:64], scheduler)
    for o, r in zip(out, ref):
        assert o["parents"] == r["parents"]
        torch.testing.assert_close(o["logits"], r["logits"], atol=1e-5, rtol=1e-5)
    assert len({tuple(o["parents"]) for o in out}) >= 5
    print(f"DRNN batch 64 ({scheduler}): {f.stats.summary()}")
    assert f.stats.mean_batch > 4


def test_calibration_centres_the_growth_decisions(ud_sentences):
    torch.manual_seed(3)
    m = DRNN(vocab_size(ud_sentences), hidden=16, word_dim=12, tag_dim=6, max_nodes=12, max_depth=4)
    with torch.no_grad():
        m.predict.u_a.bias.fill_(-3.0)  # a decoder that (almost) never grows
        assert all(len(m(s)["parents"]) == 1 for s in ud_sentences[:16])
        calibrate_decisions(m, ud_sentences[:16])
        outs = [m(s) for s in ud_sentences[:16]]
    # no decision right at 0.5, where batched and one-at-a-time rounding could disagree
    assert all((o["p_a"] - 0.5).abs().min() > 1e-6 for o in outs)
    grow = torch.cat([o["p_a"] > 0.5 for o in outs]).float().mean()
    assert 0.2 <= grow <= 0.8
    assert len({len(o["parents"]) for o in outs}) >= 3


def test_matches_eager_on_random_sentences_including_one_word(drnn):
    sents = [random_tree(n, seed=n) for n in (1, 2, 5, 9, 17)]
    assert_matches_eager(drnn, sents, list(drnn.parameters()))
