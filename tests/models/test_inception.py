"""Wide Inception-style CNN: shapes, inputs, four-branch width."""

import pytest
import torch

from batchcraft import models
from batchcraft.parallel import analyze


def test_recommender_embeddings_run_side_by_side():
    n_fields = 5
    m = models.get("recommender", n_fields=n_fields, vocab=30, dim=8, hidden=(16, 8))
    ids = m.example_input(6)
    assert ids.dtype == torch.int64 and ids.shape == (6, n_fields) and int(ids.max()) < 30
    y = m(ids)
    assert y.shape == (6,) and bool(((y > 0) & (y < 1)).all())
    a = analyze(m, ids)
    # deep + wide embedding per field and two GMF tables on level 1; MLP and head after
    assert a.width_per_level[0] == 2 * n_fields + 2 and a.depth == 1 + 2 + 1
    with pytest.raises(ValueError, match="n_fields must be >= 2"):
        models.get("recommender", n_fields=1)
