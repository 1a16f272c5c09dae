"""Every suite model at batch 64 on real UD data: values and gradients equal eager (issue 3)."""

from __future__ import annotations

import pytest
import torch

from batchcraft.data import load_sentences
from batchcraft.models import suite
from equivalence import assert_matches_eager


@pytest.fixture(scope="module")
def sentences64():
    sents = load_sentences(limit=100)
    keep = sorted(range(len(sents)), key=lambda i: (len(sents[i]), i))[:64]  # shortest: quick
    return [sents[i] for i in sorted(keep)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(suite.BUILDERS))
def test_batch_64_values_and_gradients(name, sentences64):
    torch.manual_seed(0)
    task = suite.build(name, list(sentences64), hidden=8 if name == "mvrnn" else 16)
    f = assert_matches_eager(task.fn, task.instances, list(task.model.parameters()))
    assert f.stats.instances == 64 and f.stats.fallbacks == 0
    assert f.stats.mean_batch > 4, f.stats.summary()
