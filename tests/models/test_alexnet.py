"""AlexNet matches torchvision's single-tower architecture."""

import pytest
import torch

from batchcraft import models
from batchcraft.models.alexnet import AlexNet
from batchcraft.models.deepbench import GEOMETRIES, DeepBenchConv


def test_registry_builds_alexnet():
    assert isinstance(models.get("alexnet", num_classes=10), AlexNet)


def test_parameter_count_matches_torchvision():
    # torchvision.models.alexnet() has 61,100,840 parameters.
    assert sum(p.numel() for p in AlexNet().parameters()) == 61_100_840


def test_conv_geometries():
    convs = [m for m in AlexNet().modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size[0], c.stride[0]) for c in convs] == [
        (3, 64, 11, 4), (64, 192, 5, 1), (192, 384, 3, 1), (384, 256, 3, 1), (256, 256, 3, 1)]


@pytest.mark.parametrize("size", [64, 112])
def test_forward_shape(size):
    m = AlexNet(num_classes=5).eval()
    assert m(torch.randn(2, 3, size, size)).shape == (2, 5)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_deepbench_layers(name):
    m = models.get(name)
    assert isinstance(m, DeepBenchConv)
    c, h, w = m.input_size
    y = m(torch.randn(1, c, min(h, 32), min(w, 32)))
    assert y.shape[1] == m.conv.out_channels


def test_deepbench_unknown_name():
    with pytest.raises(KeyError, match="known"):
        DeepBenchConv("nope")
