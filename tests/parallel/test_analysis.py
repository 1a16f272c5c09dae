"""Heavy operators, depth and width of hand-built graphs (Wang et al.'s width analysis)."""

import operator

import pytest
import torch
import torch.fx
from hypothesis import given, settings, strategies as st
from torch import nn

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import analyze


class Branches(nn.Module):
    """``depths[i]`` Linear layers in branch i, branches summed."""

    def __init__(self, depths, dim=8):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(*[m for _ in range(d) for m in (nn.Linear(dim, dim), nn.Tanh())]) for d in depths)

    def forward(self, x):
        out = x
        for b in self.branches:
            out = out + b(x)
        return out


def test_chain_has_width_one_and_depth_equal_to_length():
    a = analyze(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert (len(a.heavy_ops), a.depth, a.average_width, a.max_width) == (3, 3, 1.0, 1)
    assert [h.level for h in a.heavy_ops] == [1, 2, 3]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6))
def test_parallel_branches(depths):
    a = analyze(Branches(depths))
    assert len(a.heavy_ops) == sum(depths)
    assert a.depth == max(depths)
    assert a.average_width == (sum(depths) / max(depths) if max(depths) else 0.0)
    assert a.width_per_level == [sum(d > lvl for d in depths) for lvl in range(max(depths))]


def test_hand_built_fx_graph_diamond_with_functions_and_methods():
    # x -> mm(W1) -> (matmul W2 | tensor.matmul W3) -> add -> F.linear -> out
    g = torch.fx.Graph()
    root = nn.Module()
    for i, shape in enumerate([(6, 6), (6, 6), (6, 6), (3, 6)], 1):
        root.register_parameter(f"w{i}", nn.Parameter(torch.randn(*shape)))
    x = g.placeholder("x")
    w = [g.get_attr(f"w{i}") for i in range(1, 5)]
    a = g.call_function(torch.mm, (x, w[0]))
    b = g.call_function(operator.matmul, (a, w[1]))
    c = g.call_method("matmul", (a, w[2]))
    d = g.call_function(operator.add, (b, c))
    e = g.call_function(torch.nn.functional.linear, (d, w[3]))
    g.output(e)
    gm = torch.fx.GraphModule(root, g)
    res = analyze(gm, torch.randn(5, 6))
    assert [h.level for h in res.heavy_ops] == [1, 2, 2, 3]
    assert (res.depth, res.max_width) == (3, 2)
    assert res.average_width == pytest.approx(4 / 3)
    # mm/matmul: 2*M*N*K = 2*5*6*6 each; linear: 2*5*3*6
    assert [h.flops for h in res.heavy_ops] == [360, 360, 360, 180]


def test_flops_of_conv_linear_embedding():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.conv = nn.Conv2d(3, 8, 3, padding=1, groups=1)
            self.fc = nn.Linear(8 * 5 * 5, 7)

        def forward(self, img, ids):
            return self.fc(torch.flatten(self.conv(img), 1)) + self.emb(ids).sum((1, 2)).unsqueeze(1)

    res = analyze(M(), (torch.randn(2, 3, 5, 5), torch.tensor([[1, 2, 3], [4, 5, 6]])))
    flops = {h.kind: h.flops for h in res.heavy_ops}
    assert flops["conv"] == 2 * (2 * 8 * 5 * 5) * (3 * 3 * 3)
    assert flops["linear"] == 2 * 2 * 7 * 200
    assert flops["embedding"] == 2 * 3 * 4  # values read
    assert res.total_flops == sum(flops.values())
    assert res.depth == 2 and len(res.heavy_ops) == 3


def test_no_heavy_ops_gives_zero_width():
    a = analyze(nn.Sequential(nn.ReLU(), nn.Tanh()))
    assert (a.depth, a.average_width, a.heavy_ops) == (0, 0.0, [])


def test_untraceable_model_is_a_configuration_error():
    class Dynamic(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(ConfigurationError, match="cannot trace Dynamic"):
        analyze(Dynamic())
