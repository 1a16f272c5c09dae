"""A Wide & Deep / NCF-style recommender: many embedding lookups feeding MLP branches.

After Cheng et al., "Wide & Deep Learning for Recommender Systems" (DLRS 2016) and He et al.,
"Neural Collaborative Filtering" (WWW 2017): a *wide* part (one weight per categorical value,
summed), a *deep* part (concatenated field embeddings -> MLP) and a GMF part (user embedding x item
embedding). Wang et al. (arXiv 1908.04705) tune NCF and Wide & Deep; their many independent
embedding lookups make the graph wide. Sizes are ours.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WideDeepRecommender"]


class WideDeepRecommender(nn.Module):
    """Wide + deep + GMF scores for (user, item, categorical fields) rows.

    Field 0 is the user id, field 1 the item id, fields 2.. other categorical features.

    Args:
        n_fields (int): categorical fields per row (>= 2). Default: 8.
        vocab (int): ids per field. Default: 10000.
        dim (int): embedding size. Default: 64.
        hidden (tuple[int, ...]): deep MLP widths. Default: (1024, 512, 256).
    Shapes:
        input (batch, n_fields) int64 ids in [0, vocab) -> output (batch,) float32 scores in (0, 1).
    """

    def __init__(self, n_fields: int = 8, vocab: int = 10000, dim: int = 64,
                 hidden: tuple[int, ...] = (1024, 512, 256)):
        super().__init__()
        if n_fields < 2:
            raise ValueError(f"WideDeepRecommender: n_fields must be >= 2 (user, item), got {n_fields}")
        self.n_fields, self.vocab = n_fields, vocab
        self.deep_emb = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(n_fields))
        self.wide_emb = nn.ModuleList(nn.Embedding(vocab, 1) for _ in range(n_fields))
        self.gmf_user = nn.Embedding(vocab, dim)
        self.gmf_item = nn.Embedding(vocab, dim)
        dims = [n_fields * dim, *hidden]
        mlp = []
        for a, b in zip(dims, dims[1:]):
            mlp += [nn.Linear(a, b), nn.ReLU()]
        self.deep = nn.Sequential(*mlp)
        self.head = nn.Linear(hidden[-1] + dim, 1)

    def forward(self, ids):
        deep_in = torch.cat([emb(ids[:, i]) for i, emb in enumerate(self.deep_emb)], dim=1)
        wide = torch.stack([emb(ids[:, i]) for i, emb in enumerate(self.wide_emb)], dim=0).sum(0)
        gmf = self.gmf_user(ids[:, 0]) * self.gmf_item(ids[:, 1])
        logit = self.head(torch.cat([self.deep(deep_in), gmf], dim=1)) + wide
        return torch.sigmoid(logit).squeeze(1)

    def example_input(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        """Random ids of shape (batch_size, n_fields), int64 in [0, vocab)."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (batch_size, self.n_fields), generator=g)
