"""StackRNN parser per instance: argmax over legal transitions; auto-batched equals eager and batches."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from batchcraft.models.stackrnn import LEFT_ARC, RIGHT_ARC, SHIFT, StackRNNParser

from _suite_helpers import forward_batched_and_eager, shortest, vocab_size
from equivalence import assert_matches_eager, random_tree


@pytest.fixture(scope="module")
def parser(ud_sentences):
    torch.manual_seed(0)
    return StackRNNParser(vocab_size(ud_sentences), hidden=16, word_dim=16, tag_dim=8)


def _is_tree(heads: list[int]) -> bool:
    if heads.count(-1) != 1:
        return False
    for i in range(len(heads)):
        seen, j = set(), i
        while heads[j] != -1:
            if j in seen:
                return False
            seen.add(j)
            j = heads[j]
    return True


def test_parses_are_trees_and_use_only_legal_transitions(parser, ud_sentences):
    with torch.no_grad():
        for s in ud_sentences[:40]:
            out = parser(s)
            n = len(s)
            assert out["scores"].shape == (2 * n - 1, 3) and len(out["actions"]) == 2 * n - 1
            assert out["actions"].count(SHIFT) == n
            assert _is_tree(out["heads"])


def test_action_sequences_differ_between_sentences_of_the_same_length(parser, ud_sentences):
    by_len = defaultdict(set)
    with torch.no_grad():
        for s in ud_sentences[:64]:
            by_len[len(s)].add(tuple(parser(s)["actions"]))
    assert any(len(v) > 1 for v in by_len.values())  # the path depends on values, not only on n
    with torch.no_grad():
        acts = [a for s in ud_sentences[:64] for a in parser(s)["actions"]]
    assert acts.count(LEFT_ARC) > 0 and acts.count(RIGHT_ARC) > 0


@pytest.mark.parametrize("batch,scheduler", [(1, "depth"), (8, "depth"), (8, "agenda")])
def test_matches_eager_values_gradients_and_parses(parser, ud_sentences, batch, scheduler):
    sents = shortest(ud_sentences, 24)[:batch]  # 2n - 1 transitions each: keep the gradient test short
    f = assert_matches_eager(parser, sents, list(parser.parameters()), scheduler=scheduler)
    assert f.stats.fallbacks == 0 and f.stats.syncs > 0


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["agenda"])  # depth is covered at batch 8; this one is the costly run
def test_batch_64_parses_match_eager_and_still_batch(parser, ud_sentences, scheduler):
    out, ref, f = forward_batched_and_eager(parser, shortest(ud_sentences, 64), scheduler)
    for o, r in zip(out, ref):
        assert o["actions"] == r["actions"] and o["heads"] == r["heads"]
        torch.testing.assert_close(o["scores"], r["scores"], atol=1e-5, rtol=1e-5)
    print(f"StackRNN batch 64 ({scheduler}): {f.stats.summary()}")
    assert f.stats.mean_batch > 4


def test_instances_in_scrambled_order_get_their_own_parses(parser, ud_sentences):
    # operands of each batched call come from different rows in each order (DyNet #1258, #1666)
    sents = shortest(ud_sentences, 12)
    out, ref, _ = forward_batched_and_eager(parser, sents)
    out_rev, _, _ = forward_batched_and_eager(parser, sents[::-1])
    for o, r, rv in zip(out, ref, out_rev[::-1]):
        assert o["actions"] == r["actions"] == rv["actions"]
        torch.testing.assert_close(o["scores"], rv["scores"], atol=1e-6, rtol=1e-6)


def test_matches_eager_on_random_sentences_including_one_word(parser):
    sents = [random_tree(n, seed=n) for n in (1, 2, 5, 9)]
    f = assert_matches_eager(parser, sents, list(parser.parameters()))
    assert len(f([sents[0]])[0]["actions"]) == 1  # one word: a single SHIFT
