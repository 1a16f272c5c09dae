"""Torch calls made by the body of a module that instance code imports for the first time
(reliability #313): eager keeps its tensors as plain tensors; recorded, they were lazy values that
failed once the call ended ("a lazy value was used outside batchcraft.autobatch"). Class bodies and
``exec``'d statements run per instance and are recorded as function code is (a hostile helper's
finds against the first version of the fix, stop 51)."""

from __future__ import annotations

import sys

import pytest
import torch

from batchcraft import autobatch
from equivalence import CORES

MODULE_SOURCE = """
import torch
import torch.nn.functional as F
EPS = torch.tensor(1e-3)
ONES = torch.ones(3) * 2
STACKED = torch.stack([torch.zeros(3), torch.ones(3)])
ACT = F.relu(torch.ones(3))
OUT = torch.nn.Linear(3, 3)(torch.ones(3))
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
    for v in (mod.EPS, mod.ONES, mod.STACKED, mod.ACT, mod.OUT):
        assert type(v) is torch.Tensor
    torch.testing.assert_close(mod.ONES + 1, torch.full((3,), 3.0))  # usable after the call
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, x + 1e-3 + 3)
    assert f.stats.batched_calls > 0  # the instances' own work still batched


G = torch.zeros(3)


def _exec_add(x):
    exec("G.add_(1)", {"G": G})
    return x * G


def _class_add(x):
    class C:
        G.add_(1)
    return x * G


def _class_buffer(x):
    class C:
        buf = torch.zeros(2, 3)
        buf[0] = x
    return C.buf.sum(0)


def _class_accumulate(x):
    class C:
        acc = torch.zeros(3)
        acc += x
    return C.acc


def _class_nested_lazy(x):
    class C:
        t = torch.tensor([[x[0], x[1]]])
    return C.t * 1


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("body", [_exec_add, _class_add, _class_buffer, _class_accumulate, _class_nested_lazy])
def test_class_bodies_and_exec_d_code_run_per_instance_as_in_eager(core, body):
    xs = [torch.randn(3) for _ in range(3)]
    G.zero_()
    ref = [body(x).clone() for x in xs]
    G.zero_()
    out = autobatch(body, core=core)(xs)
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
