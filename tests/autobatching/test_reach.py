"""The bounded walk that finds the modules and tensors a static block may read (reach.py)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from batchcraft.autobatching import reach as reach_mod
from batchcraft.autobatching.reach import reach, reachable_modules


class _Box:
    pass


def test_finds_modules_through_closures_containers_objects_and_partials():
    a, b, c, d = (nn.Linear(2, 2) for _ in range(4))
    box = _Box()
    box.inner = {"deep": [c]}
    w = torch.randn(2)

    def helper(x, extra):
        return extra(x)

    fn = functools.partial(helper, extra=lambda x: a(x) + b(x) + box.inner["deep"][0](x) + w)
    mods, tensors = reach(fn)
    assert {id(m) for m in mods} == {id(a), id(b), id(c)}
    assert d not in mods
    assert any(t is w for t in tensors)


def test_cycles_and_self_references_end():
    box = _Box()
    box.me = box
    box.items = [box, [box]]
    box.items[1].append(box.items)
    lin = nn.Linear(2, 2)
    box.lin = lin
    assert reachable_modules(lambda x: box.lin(x)) == [lin]


def test_the_walk_is_bounded_in_depth_and_width(monkeypatch):
    lin = nn.Linear(2, 2)
    deep = [[[[[[[[lin]]]]]]]]  # deeper than MAX_DEPTH
    assert reachable_modules(lambda: deep) == []
    monkeypatch.setattr(reach_mod, "MAX_ITEMS", 3)
    wide = [None] * 10 + [lin]
    assert reachable_modules(lambda: wide) == []
    assert reachable_modules(lambda: wide[-1:]) == []  # (the slice is computed at run time)


def test_library_modules_are_not_walked():
    # ``torch.tanh`` and friends: nothing of the user's lives there
    mods, tensors = reach(lambda x: torch.tanh(torch.sigmoid(x)))
    assert mods == [] and tensors == []


def test_the_walk_stops_after_max_visits(monkeypatch):
    lin = nn.Linear(2, 2)
    data = [lin] + [_Box() for _ in range(20)]  # (the walk takes the last members first)
    assert reachable_modules(lambda: data) == [lin]
    monkeypatch.setattr(reach_mod, "MAX_VISITS", 5)
    assert reachable_modules(lambda: data) == []
