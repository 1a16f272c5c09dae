"""A wide Inception-style CNN: several parallel convolution branches per block.

After Szegedy et al., "Going Deeper with Convolutions" (GoogLeNet, CVPR 2015): each block runs a
1x1, a 1x1->3x3, a 1x1->3x3->3x3 (factorised 5x5, as in Inception v3) and a pool->1x1 branch on
the same input and concatenates them. Wang et al. (arXiv 1908.04705, §5) use Inception models as
their wide graphs, where inter-op parallelism pays. Sized for CPU benchmarks on small images
(3x32x32 by default); channel counts are ours.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["InceptionBlock", "InceptionWide"]


def _conv(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2), nn.ReLU())


class InceptionBlock(nn.Module):
    """Four branches concatenated on channels: (b, cin, h, w) -> (b, 4 * branch, h, w)."""

    def __init__(self, cin: int, branch: int):
        super().__init__()
        self.b1 = _conv(cin, branch, 1)
        self.b3 = nn.Sequential(_conv(cin, branch // 2, 1), _conv(branch // 2, branch, 3))
        self.b5 = nn.Sequential(_conv(cin, branch // 2, 1), _conv(branch // 2, branch, 3),
                                _conv(branch, branch, 3))
        self.bp = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), _conv(cin, branch, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class InceptionWide(nn.Module):
    """Stem convolution, ``blocks`` Inception blocks (a 2x2 max-pool after the first), classifier.

    Args:
        blocks (int): Inception blocks (>= 1). Default: 3.
        branch (int): output channels of each branch. Default: 32.
        image_size (int): input height = width. Default: 32.
        num_classes (int): Default: 10.
    Shapes:
        input (batch, 3, image_size, image_size) float32 -> output (batch, num_classes).
    """

    def __init__(self, blocks: int = 3, branch: int = 32, image_size: int = 32, num_classes: int = 10):
        super().__init__()
        if blocks < 1:
            raise ValueError(f"InceptionWide: blocks must be >= 1, got {blocks}")
        self.image_size = image_size
        self.stem = _conv(3, 2 * branch, 3)
        layers, cin = [], 2 * branch
        for i in range(blocks):
            layers.append(InceptionBlock(cin, branch))
            cin = 4 * branch
            if i == 0:
                layers.append(nn.MaxPool2d(2))
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.pool(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(x, 1))

    def example_input(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        """Random images of shape (batch_size, 3, image_size, image_size), float32."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 3, self.image_size, self.image_size, generator=g)
