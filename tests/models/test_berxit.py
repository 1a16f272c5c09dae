"""Berxit early exit per instance: exits differ, padding is invisible, auto-batched equals eager."""

from __future__ import annotations

import pytest
import torch

from batchcraft.models.berxit import Berxit, calibrate_threshold

from _suite_helpers import forward_batched_and_eager, vocab_size
from equivalence import assert_matches_eager, random_tree


@pytest.fixture(scope="module")
def berxit(ud_sentences):
    torch.manual_seed(0)
    m = Berxit(vocab_size(ud_sentences), d_model=32, n_heads=2, d_ff=48).eval()
    m.threshold = calibrate_threshold(m, ud_sentences[:32])
    return m


def test_instances_exit_at_different_layers(berxit, ud_sentences):
    with torch.no_grad():
        exits = [berxit(s)[1] for s in ud_sentences[:64]]
    assert len(set(exits)) >= 2
    assert all(1 <= e <= 6 for e in exits)


def test_padding_does_not_change_the_result(berxit, ud_sentences):
    unpadded = Berxit(vocab_size(ud_sentences), d_model=32, n_heads=2, d_ff=48, pad_to=1).eval()
    unpadded.load_state_dict(berxit.state_dict())
    unpadded.threshold = berxit.threshold
    with torch.no_grad():
        for s in ud_sentences[:6]:
            (a, ea), (b, eb) = berxit(s), unpadded(s)
            assert ea == eb
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_too_long_sentence_is_a_clear_error(ud_sentences):
    m = Berxit(vocab_size(ud_sentences), d_model=8, n_heads=1, d_ff=8, max_len=16)
    long = max(ud_sentences, key=len)
    assert len(long) >= 16
    with pytest.raises(ValueError, match="max_len=16"):
        m(long)


@pytest.mark.parametrize("batch,scheduler", [(1, "depth"), (8, "depth"), (8, "agenda")])
def test_matches_eager_values_and_gradients(berxit, ud_sentences, batch, scheduler):
    sents = ud_sentences[:batch]
    f = assert_matches_eager(berxit, sents, list(berxit.parameters()), scheduler=scheduler)
    assert f.stats.fallbacks == 0


@pytest.mark.parametrize("scheduler", ["depth", "agenda"])
def test_batch_64_exits_match_eager_and_still_batch(berxit, ud_sentences, scheduler):
    out, ref, f = forward_batched_and_eager(berxit, ud_sentences[:64], scheduler)
    assert [o[1] for o in out] == [r[1] for r in ref]
    assert len({o[1] for o in out}) >= 2
    for o, r in zip(out, ref):
        torch.testing.assert_close(o[0], r[0], atol=1e-5, rtol=1e-5)
    print(f"Berxit batch 64 ({scheduler}): {f.stats.summary()}")
    assert f.stats.mean_batch > 4


def test_matches_eager_on_random_sentences_including_one_word(berxit):
    sents = [random_tree(n, seed=n) for n in (1, 2, 15, 16, 31)]  # around the padding boundaries
    assert_matches_eager(berxit, sents, list(berxit.parameters()))
