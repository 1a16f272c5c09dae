"""The schedulers' notes (autobatching/schedule.py): operations split by their instances' shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch
from batchcraft.autobatching import schedule
from equivalence import CORES, assert_matches_eager


def _tagger():
    torch.manual_seed(0)
    emb, lin = nn.Embedding(100, 8), nn.Linear(8, 3)

    def whole(ids):  # one lookup of the whole sentence: one input shape per sentence length
        return lin(emb(torch.tensor(ids))).sum(0)

    def per_token(ids):  # one lookup per word: every lookup has one shape
        return sum(lin(emb(torch.tensor(i))) for i in ids)

    return whole, per_token


SENTENCES = [list(range(1 + n % 7)) for n in range(24)]  # 7 lengths


@pytest.mark.parametrize("core", CORES)
def test_an_operation_split_by_instance_shapes_is_noted_with_its_shapes(core):
    whole, per_token = _tagger()
    with torch.no_grad():
        f = assert_matches_eager(whole, SENTENCES, [], core=core)
        g = assert_matches_eager(per_token, SENTENCES, [], core=core)
    assert f.stats.shape_splits.get("embedding") == 7 and f.stats.shape_splits.get("linear") == 7
    assert "embedding (7 shapes)" in f.stats.summary()
    assert g.stats.shape_splits == {}
    assert "one group per input shape" not in g.stats.summary()


def test_fewer_shapes_than_the_threshold_are_not_noted():
    whole, _ = _tagger()
    few = [list(range(1 + n % (schedule.SPLIT_MIN - 1))) for n in range(12)]
    with torch.no_grad():
        f = assert_matches_eager(whole, few, [])
    assert f.stats.shape_splits == {}


def test_the_agenda_scheduler_batches_its_own_way_and_notes_nothing():
    whole, _ = _tagger()
    with torch.no_grad():
        f = assert_matches_eager(whole, SENTENCES, [], scheduler="agenda")
    assert f.stats.shape_splits == {}
