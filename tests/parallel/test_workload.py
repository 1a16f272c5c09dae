"""Workloads: inputs for tensor models and for the auto-batched TreeLSTM."""

import pytest
import torch
from torch import nn

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.workload import build_workload, make_input


def test_tensor_models_get_inputs_from_example_input_or_first_layer():
    w = build_workload("recommender", model_kwargs={"vocab": 20})
    x = w.make_batch(5)
    assert x.shape == (5, 8) and x.dtype == torch.int64 and w.traceable
    assert w.call(x).shape == (5,)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    assert make_input(conv, 2, image_size=9).shape == (2, 3, 9, 9)
    assert make_input(nn.Sequential(nn.Linear(6, 2)), 3).shape == (3, 6)
    with pytest.raises(ConfigurationError, match="cannot derive an input shape"):
        make_input(nn.Sequential(nn.ReLU()), 1)
    with pytest.raises(ConfigurationError, match="batch_size must be an int >= 1"):
        make_input(conv, 0)


def test_unknown_model():
    with pytest.raises(ConfigurationError, match="unknown model 'nope'"):
        build_workload("nope")


def test_treelstm_batches_are_real_sentences_run_auto_batched():
    w = build_workload("treelstm", model_kwargs={"hidden": 16})
    assert not w.traceable
    batch = w.make_batch(3)
    assert len(batch) == 3 and all(hasattr(s, "word_ids") for s in batch)
    with torch.no_grad():
        out = w.call(batch)
        ref = [w.model(s) for s in batch]  # per-instance eager
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(w.make_batch(300)) == 300  # more than loaded: reused cyclically
