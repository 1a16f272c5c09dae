"""Fast submodule/parameter reads during a call (autobatching/attrs.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch
from batchcraft.autobatching.attrs import FastAttributes, _roots
from equivalence import CORES


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.seen = []

    def forward(self, x):
        self.seen.append(("lin" in self.__dict__, "scale" in self.__dict__))
        return self.lin(x) * self.scale


@pytest.mark.parametrize("core", CORES)
def test_reads_go_through_dict_during_the_call_and_the_dict_is_restored(core):
    torch.manual_seed(0)
    net = Net()
    before = dict(net.__dict__)
    xs = [torch.randn(3) for _ in range(4)]
    out = autobatch(net, core=core)(xs)
    assert all(s == (True, True) for s in net.seen)
    assert net.__dict__.keys() == before.keys() and "lin" not in net.__dict__
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, net(x))
    net.seen.clear()
    autobatch(net, core=core, fast_attributes=False)(xs)
    assert all(s == (False, False) for s in net.seen)


def test_dict_is_restored_when_an_instance_raises():
    net = Net()
    keys = set(net.__dict__)

    def f(x):
        if x.sum() > 0:
            raise ValueError("boom")
        return net(x)

    with pytest.raises(Exception, match="boom"):
        autobatch(f)([torch.ones(3), -torch.ones(3)])
    assert set(net.__dict__) == keys


def test_a_submodule_replaced_during_the_call_is_seen():
    net = Net()
    other = nn.Linear(3, 3)

    def f(x):
        y = net.lin(x)
        net.lin = other  # Module.__setattr__ drops the copy from __dict__
        return y + net.lin(x)

    xs = [torch.randn(3) for _ in range(2)]
    first = net.lin
    out = autobatch(f)(xs)
    assert net.lin is other
    torch.testing.assert_close(out[0], first(xs[0]) + other(xs[0]))
    torch.testing.assert_close(out[1], other(xs[1]) + other(xs[1]))


def test_roots_are_found_in_methods_partials_and_closures():
    import functools

    a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    assert _roots(a.forward) == [a]
    assert _roots(functools.partial(lambda m, x: m(x), b)) == [b]
    assert _roots(lambda x: c(x)) == [c]


def test_classes_with_their_own_getattr_and_class_attributes_are_left_alone():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(1, 1)

        def __getattr__(self, name):
            return super().__getattr__(name)

    class Shadow(nn.Module):
        weight = "class attribute"

        def __init__(self):
            super().__init__()
            self._parameters["weight"] = nn.Parameter(torch.ones(1))

    m, s = Custom(), Shadow()
    with FastAttributes(lambda x: m(x) + s(x)) as fa:
        assert "inner" not in m.__dict__ and "weight" not in s.__dict__
        # only the plain Linear inside Custom gets its parameters copied
        assert {name for d, name, _ in fa.added} == {"weight", "bias"}
        assert all(d is m.inner.__dict__ for d, _, _ in fa.added)
    assert "weight" not in m.inner.__dict__
