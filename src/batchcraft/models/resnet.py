"""ResNet-18 (He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016,
arXiv 1512.03385), defined from scratch.

Architecture, parameter names and initialisation match ``torchvision.models.resnet18`` (v1.5:
the stride of a down-sampling block sits on its 3x3 convolution), so a torchvision state dict
loads into :class:`ResNet` unchanged. torchvision itself is not imported.

Used by the micro-batching benchmark (μ-cuDNN reports 1.21x on ResNet-18, P100) and by the
parallelism tuner.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "ResNet", "resnet18"]


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projected) shortcut.

    Input (N, in_planes, H, W) -> output (N, planes, H/stride, W/stride).
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet built from :class:`BasicBlock` stages.

    Args:
        layers (sequence of 4 ints): blocks per stage; (2, 2, 2, 2) is ResNet-18.
        num_classes (int): size of the final linear layer. Default: 1000.

    Input (N, 3, H, W) float32 with H, W >= 32 -> logits (N, num_classes).
    """

    def __init__(self, layers=(2, 2, 2, 2), num_classes: int = 1000):
        super().__init__()
        if len(layers) != 4 or any(int(n) < 1 for n in layers):
            raise ValueError(f"ResNet: layers must be 4 positive block counts, got {tuple(layers)!r}")
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        planes, in_planes = (64, 128, 256, 512), 64
        for i, (p, n) in enumerate(zip(planes, layers)):
            blocks = [BasicBlock(in_planes, p, 1 if i == 0 else 2)]
            blocks += [BasicBlock(p, p) for _ in range(int(n) - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            in_planes = p
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        # torchvision's initialisation: He (fan_out) for convolutions, BN as identity.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: 4 stages of 2 basic blocks, 11.7 M parameters at 1000 classes."""
    return ResNet((2, 2, 2, 2), num_classes=num_classes)
