"""CUDA path of auto-batching; skipped cleanly where there is no GPU (CI never has one)."""

from __future__ import annotations

import pytest
import torch

from batchcraft import autobatch
from batchcraft.models.treelstm import TreeLSTM

from equivalence import random_tree

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_treelstm_on_cuda_matches_eager():
    torch.manual_seed(0)
    m = TreeLSTM(vocab_size=60, hidden=32, word_dim=16, tag_dim=8).cuda()
    trees = [random_tree(n, seed=n) for n in (1, 4, 9, 16)]
    out = autobatch(m)(trees)
    for o, t in zip(out, trees):
        assert o.is_cuda
        torch.testing.assert_close(o, m(t), atol=1e-5, rtol=1e-5)
