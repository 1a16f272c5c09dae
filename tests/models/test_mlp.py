"""MLP fc512 / fc4096: shapes, inputs, width 1."""

import pytest

from batchcraft import models
from batchcraft.parallel import analyze


@pytest.mark.parametrize("name,hidden", [("mlp_fc512", 512), ("mlp_fc4096", 4096)])
def test_mlp_shapes_and_width_one(name, hidden):
    m = models.get(name, layers=2, out_features=3)
    x = m.example_input(4)
    assert x.shape == (4, hidden) and m(x).shape == (4, 3)
    a = analyze(m)
    assert (a.depth, a.average_width) == (3, 1.0)  # 2 hidden + head, one after the other
    with pytest.raises(ValueError, match="layers and hidden must be >= 1"):
        models.get(name, layers=0)
