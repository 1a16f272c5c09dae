"""AlexNet (Krizhevsky, Sutskever, Hinton, "ImageNet Classification with Deep Convolutional
Neural Networks", NeurIPS 2012), in the single-tower form of Krizhevsky's "One weird trick"
(arXiv 1404.5997) that ``torchvision.models.alexnet`` uses; defined from scratch.

Parameter names and shapes match torchvision's, so its state dict loads unchanged.
μ-cuDNN (arXiv 1804.04806) reports 1.63x on AlexNet (P100).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AlexNet", "alexnet"]


class AlexNet(nn.Module):
    """Five convolutions (11x11/4, 5x5, three 3x3) and three linear layers.

    Args:
        num_classes (int): outputs of the last linear layer. Default: 1000.
        dropout (float): dropout probability before the first two linear layers. Default: 0.5.

    Input (N, 3, H, W) float32 with H, W >= 63 -> logits (N, num_classes); the adaptive pool
    makes any such resolution valid (224 is the paper's).
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def alexnet(num_classes: int = 1000, dropout: float = 0.5) -> AlexNet:
    """AlexNet with 61.1 M parameters at 1000 classes."""
    return AlexNet(num_classes=num_classes, dropout=dropout)
