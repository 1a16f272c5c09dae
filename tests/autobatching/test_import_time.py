"""Torch calls made by import-time code inside instance code (reliability #313): a module imported
for the first time by an instance, a class body, ``exec``'d statements. Eager keeps their tensors
as plain tensors; recorded, they were lazy values that failed once the call ended ("a lazy value
was used outside batchcraft.autobatch")."""

from __future__ import annotations

import sys

import pytest
import torch

from batchcraft import autobatch
from equivalence import CORES

MODULE_SOURCE = """
import torch
EPS = torch.tensor(1e-3)
ONES = torch.ones(3) * 2
STACKED = torch.stack([torch.zeros(3), torch.ones(3)])
"""


@pytest.mark.parametrize("core", CORES)
def test_a_module_first_imported_by_an_instance_keeps_plain_tensors(core, tmp_path, monkeypatch):
    name = f"bc_import_time_{core}"
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)

    def fn(x):
        mod = __import__(name)
        return x + mod.EPS + mod.ONES + mod.STACKED[1]

    xs = [torch.randn(3) for _ in range(3)]
    f = autobatch(fn, core=core)
    out = f(xs)
    mod = sys.modules[name]
    for v in (mod.EPS, mod.ONES, mod.STACKED):
        assert type(v) is torch.Tensor
    torch.testing.assert_close(mod.ONES + 1, torch.full((3,), 3.0))  # usable after the call
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, x + 1e-3 + 3)
    assert f.stats.batched_calls > 0  # the instances' own work still batched


@pytest.mark.parametrize("core", CORES)
def test_class_bodies_and_exec_in_instance_code_make_plain_tensors(core):
    made = []

    def fn(x):
        class Consts:
            W = torch.ones(3) * 3

        ns = {"torch": torch}
        exec("T = torch.arange(3.0)\nU = T * 2", ns)
        made.append((Consts.W, ns["T"], ns["U"]))
        w = torch.tensor(2.0)  # a function's own factory call: a per-instance value, as before
        return x * Consts.W + ns["U"] + w

    xs = [torch.randn(3) for _ in range(2)]
    ref = [fn(x) for x in xs]
    eager_types = [tuple(type(t) for t in m) for m in made]
    made.clear()
    out = autobatch(fn, core=core)(xs)
    assert [tuple(type(t) for t in m) for m in made] == eager_types
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("core", CORES)
def test_exec_d_code_on_lazy_values_is_still_recorded(core):
    def fn(x):
        ns = {"x": x * 2}
        exec("y = x + 1", ns)  # a lazy argument: recorded as any other call
        return ns["y"]

    xs = [torch.randn(3) for _ in range(3)]
    f = autobatch(fn, core=core)
    for o, x in zip(f(xs), xs):
        torch.testing.assert_close(o, x * 2 + 1)
