"""ResNet-18 matches torchvision's architecture: parameter names, shapes, counts, output shape."""

import pytest
import torch

from batchcraft import models
from batchcraft.models.resnet import ResNet, resnet18


def test_registry_builds_resnet18():
    m = models.get("resnet18", num_classes=10)
    assert isinstance(m, ResNet)
    assert m.fc.out_features == 10


def test_parameter_count_matches_torchvision():
    # torchvision.models.resnet18() has 11,689,512 parameters (documented on its model card).
    assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512


def test_state_dict_names_follow_torchvision():
    keys = set(resnet18().state_dict())
    for k in ["conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
              "layer2.0.downsample.1.num_batches_tracked", "layer4.1.bn2.bias", "fc.weight", "fc.bias"]:
        assert k in keys
    assert "layer1.0.downsample.0.weight" not in keys  # identity shortcut in the first stage
    # 20 convolutions: stem + 16 in blocks + 3 projections
    convs = [m for m in resnet18().modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 20


def test_downsampling_stride_on_3x3_conv():
    m = resnet18()
    assert m.layer2[0].conv1.stride == (2, 2)
    assert m.layer2[0].downsample[0].stride == (2, 2)
    assert m.layer2[0].conv2.stride == (1, 1)


@pytest.mark.parametrize("size", [32, 64])
def test_forward_shapes_and_gradients(size):
    torch.manual_seed(0)
    m = resnet18(num_classes=7)
    x = torch.randn(2, 3, size, size, requires_grad=True)
    y = m(x)
    assert y.shape == (2, 7)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert m.conv1.weight.grad is not None


def test_bad_layers_rejected():
    with pytest.raises(ValueError, match="layers"):
        ResNet((2, 2, 2))
