"""Wide Inception-style CNN: shapes, inputs, four-branch width."""

import pytest
import torch

from batchcraft import models
from batchcraft.parallel import analyze


def test_inception_blocks_are_four_branches_wide():
    m = models.get("inception_wide", blocks=2, branch=8, image_size=16, num_classes=5)
    x = m.example_input(2)
    assert x.shape == (2, 3, 16, 16) and m(x).shape == (2, 5)
    a = analyze(m, x)
    # stem, then per block 7 convs over 3 levels (1x1 | 1x1-3x3 | 1x1-3x3-3x3 | pool-1x1), then fc
    assert len(a.heavy_ops) == 1 + 2 * 7 + 1 and a.depth == 1 + 2 * 3 + 1
    assert a.max_width == 4
    assert torch.equal(m.example_input(2, seed=1), m.example_input(2, seed=1))
    with pytest.raises(ValueError, match="blocks must be >= 1"):
        models.get("inception_wide", blocks=0)
