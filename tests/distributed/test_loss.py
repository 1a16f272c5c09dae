"""AutobatchLoss: one autobatch call, summed loss, gradient scaled for DDP's average."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft.distributed import AutobatchLoss


class SquareLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x).pow(2).sum()


def test_value_and_gradient_equal_eager_sum_and_scale():
    torch.manual_seed(0)
    model = SquareLoss()
    xs = [torch.randn(3) for _ in range(5)]
    eager = sum(model(x) for x in xs)
    (g_eager,) = torch.autograd.grad(eager, [model.lin.weight])
    for scale in (1.0, 3.0):
        loss = AutobatchLoss(model, grad_scale=scale)(xs)
        torch.testing.assert_close(loss, eager)
        (g,) = torch.autograd.grad(loss, [model.lin.weight])
        torch.testing.assert_close(g, g_eager * scale)


def test_default_scale_is_one_outside_torch_distributed():
    model = SquareLoss()
    loss_fn = AutobatchLoss(model)
    xs = [torch.randn(3), torch.randn(3)]
    (g,) = torch.autograd.grad(loss_fn(xs), [model.lin.weight])
    (g_eager,) = torch.autograd.grad(sum(model(x) for x in xs), [model.lin.weight])
    torch.testing.assert_close(g, g_eager)
    assert loss_fn.stats.instances == 2


def test_empty_shard_gives_zero_reaching_every_parameter():
    model = SquareLoss()
    loss = AutobatchLoss(model)([])
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_one_instance_instead_of_a_list_is_refused():
    with pytest.raises(TypeError, match="once per step"):
        AutobatchLoss(SquareLoss())(torch.randn(3))


def test_non_scalar_loss_is_refused():
    with pytest.raises(ValueError, match="instance 0 gave"):
        AutobatchLoss(nn.Linear(3, 2))([torch.randn(3)])


def test_zero_term_gives_unused_parameters_zero_gradients_not_none():
    model = SquareLoss()
    xs = [torch.randn(3)]
    AutobatchLoss(model)(xs).backward()
    assert model.unused.weight.grad is None
    AutobatchLoss(model, zero_term=True)(xs).backward()
    assert model.unused.weight.grad is not None and not model.unused.weight.grad.any()
