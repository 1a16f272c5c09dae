"""Multi-layer perceptrons FC512 and FC4096: deep, one heavy operator wide.

The fully connected models of Wang et al., "Exploiting Parallelism Opportunities with Deep Learning
Frameworks" (arXiv 1908.04705, §2: FC512 and FC4K, stacks of fully connected layers of 512 and 4096
units). Their graph has average width 1, so inter-op parallelism cannot help; the best
configuration comes from intra-op threads, instances and batch size alone. Four hidden layers is our
choice (the paper's layer count is not reproduced here).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP", "mlp_fc512", "mlp_fc4096"]


class MLP(nn.Module):
    """Stack of ``layers`` Linear(hidden, hidden) + ReLU, then Linear(hidden, out_features).

    Args:
        hidden (int): units per hidden layer. Default: 512.
        layers (int): hidden layers (>= 1). Default: 4.
        in_features (int | None): input size. Default: None (= hidden).
        out_features (int): output size. Default: 10.
    Shapes:
        input (batch, in_features) float32 -> output (batch, out_features).
    """

    def __init__(self, hidden: int = 512, layers: int = 4, in_features: int | None = None,
                 out_features: int = 10):
        super().__init__()
        if layers < 1 or hidden < 1:
            raise ValueError(f"MLP: layers and hidden must be >= 1, got layers={layers}, hidden={hidden}")
        self.in_features = hidden if in_features is None else in_features
        dims = [self.in_features] + [hidden] * layers
        body = []
        for a, b in zip(dims, dims[1:]):
            body += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*body)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.head(self.body(x))

    def example_input(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        """Random input of shape (batch_size, in_features), float32."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, self.in_features, generator=g)


def mlp_fc512(**kwargs) -> MLP:
    """FC512: four hidden layers of 512 units."""
    return MLP(hidden=512, **kwargs)


def mlp_fc4096(**kwargs) -> MLP:
    """FC4096 (the paper's FC4K): four hidden layers of 4096 units."""
    return MLP(hidden=4096, **kwargs)
