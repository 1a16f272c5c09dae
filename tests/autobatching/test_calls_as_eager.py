"""Module calls, cells and modes as eager sees them, on every recording core: hostile finds of
stop 36 on the fast call paths (reliability #143-#160). The C core's own objects are tested in
``test_fast_functions.py``; these hold for the Python core too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from batchcraft import autobatch
from batchcraft.errors import InstanceError

from equivalence import CORES


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
@pytest.mark.parametrize("core", CORES)
def test_cell_steps_match_eager_with_weights_swapped_between_steps(cls, core):
    torch.manual_seed(0)
    cell = cls(3, 4)
    params = list(cell.parameters())
    spare = nn.Parameter(torch.randn_like(cell.weight_hh))

    def f(xs):
        h = torch.zeros(4) * xs[0].sum()  # a lazy state: the C core's direct path from the 2nd step on
        state = (h, h * 1) if cls is nn.LSTMCell else h
        for t, x in enumerate(xs):
            if t == 2:  # a new weight object: the cached check must not be reused
                cell.weight_hh = spare
            state = cell(x, state)
            if t == 2:
                cell.weight_hh = params[1]
        return state[0] if cls is nn.LSTMCell else state

    seqs = [[torch.randn(3) for _ in range(n)] for n in (4, 2, 5)]
    ref = [f(s) for s in seqs]
    gref = torch.autograd.grad(sum(r.sum() for r in ref), params + [spare], allow_unused=True, materialize_grads=True)
    out = autobatch(f, core=core)(seqs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    g = torch.autograd.grad(sum(o.sum() for o in out), params + [spare], allow_unused=True, materialize_grads=True)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b)
    assert cell.weight_hh is params[1]


@pytest.mark.parametrize("core", CORES)
def test_an_embedding_property_that_replaces_the_weight_reads_as_forward(core):
    # the C path held the weight without a reference while a property ran (freed memory), and
    # read the settings before the weight (forward reads the weight first)
    pool = [nn.Parameter(torch.full((10, 4), float(i))) for i in range(100)]

    class SwapEmb(nn.Embedding):
        @property
        def max_norm(self):
            self._parameters["weight"] = pool.pop()  # drops the last reference of the old one
            return None

        @max_norm.setter
        def max_norm(self, v):
            pass

    emb = SwapEmb(10, 4)
    ids = list(range(5)) * 3
    emb._parameters["weight"] = pool.pop()
    out = autobatch(lambda i: emb(torch.tensor(i)), core=core)(ids)
    pool[:] = [nn.Parameter(torch.full((10, 4), float(i))) for i in range(100)]
    emb._parameters["weight"] = pool.pop()
    ref = [emb(torch.tensor(i)) for i in ids]
    assert [o[0].item() for o in out] == [r[0].item() for r in ref]


@pytest.mark.parametrize("core", CORES)
def test_a_replaced_f_linear_is_called_by_linear_modules_and_not_by_cells(core, monkeypatch):
    import torch.nn.functional as F

    torch.manual_seed(0)
    lin, gru, lstm = nn.Linear(4, 4), nn.GRUCell(4, 4), nn.LSTMCell(4, 4)
    original = F.linear
    monkeypatch.setattr(F, "linear", lambda i, w, b=None: original(i, w, b) * 10)

    def f(s):
        h = s[0] * 0
        st = (h, h)
        for x in s:
            h = gru(x, h)  # eager cells call the fused ATen cell, never F.linear
            st = lstm(x, st)
        return lin(h) + st[0]  # nn.Linear.forward calls F.linear as it is now

    seqs = [[torch.randn(4) for _ in range(n)] for n in (3, 2, 4)]
    ref = [f(s) for s in seqs]
    for o, r in zip(autobatch(f, core=core)(seqs), ref):
        torch.testing.assert_close(o, r)


def test_wrappers_installed_before_batchcraft_is_imported_still_run(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "wrapped.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "_call = nn.Module.__call__\n"
        "def call(self, *a, **k):\n"
        "    return _call(self, *a, **k) * 2\n"
        "nn.Module.__call__ = call  # a profiler's wrapper, installed first\n"
        "_fwd = nn.GRUCell.forward\n"
        "nn.GRUCell.forward = lambda self, x, h=None: _fwd(self, x, h) + 100\n"
        "from batchcraft import autobatch\n"
        "torch.manual_seed(0)\n"
        "lin, emb, gru = nn.Linear(4, 4), nn.Embedding(10, 4), nn.GRUCell(4, 4)\n"
        "f = lambda x: gru(lin(x) + emb(torch.tensor(3)), x * 1)\n"
        "xs = [torch.randn(4) for _ in range(3)]\n"
        "ref = [f(x) for x in xs]\n"
        f"for core in {tuple(CORES)!r}:\n"
        "    out = autobatch(f, core=core)(xs)\n"
        "    assert all(torch.allclose(o, r) for o, r in zip(out, ref)), core\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("core", CORES)
def test_a_cell_subclass_whose_forward_is_a_staticmethod_is_called_as_eager(core):
    class Gate(nn.GRUCell):
        @staticmethod
        def forward(x, h):
            return torch.tanh(x + h)

    g = Gate(4, 4)
    xs = [torch.randn(4) for _ in range(2)]
    for o, x in zip(autobatch(lambda x: g(x, x * 1), core=core)(xs), xs):
        torch.testing.assert_close(o, torch.tanh(2 * x))


@pytest.mark.parametrize("core", CORES)
def test_a_mode_entered_around_the_call_sees_every_operation_as_in_eager(core):
    class Scale(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.sigmoid else out

    lin = nn.Linear(4, 4)
    xs = [torch.randn(4) for _ in range(3)]
    f = autobatch(lambda x: torch.sigmoid(lin(x)), core=core)
    with Scale():
        ref = [torch.sigmoid(lin(x)) for x in xs]
        with pytest.warns(RuntimeWarning, match="mode active around the call"):
            out = f(xs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    assert f.stats.fallbacks == 3 and any("Scale" in k for k in f.stats.fallback_reasons)
    with Scale():
        f(xs)  # warned once per function
    out = f(xs)  # without the mode: batched again
    assert f.stats.fallbacks == 0 and f.stats.batched_calls > 0


@pytest.mark.parametrize("around", ["disable", "disable_subclass", "dispatch"])
def test_disabled_dispatch_or_a_dispatch_mode_around_the_call_runs_as_eager(around):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def ctx():
        return {"disable": torch._C.DisableTorchFunction, "disable_subclass": torch._C.DisableTorchFunctionSubclass,
                "dispatch": Count}[around]()

    lin = nn.Linear(4, 4)
    xs = [torch.randn(4) for _ in range(3)]
    f = autobatch(lambda x: torch.tanh(lin(x)))
    with ctx():
        ref = [torch.tanh(lin(x)) for x in xs]
        eager_calls, Count.calls = Count.calls, 0
        with pytest.warns(RuntimeWarning, match="active around the call"):
            out = f(xs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    assert f.stats.fallbacks == 3 and not f.stats.fibers
    assert Count.calls == eager_calls  # the dispatch mode saw what it sees in eager


def test_an_instance_error_under_the_eager_fallback_names_the_instance():
    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def f(x):
        if x.sum() > 100:
            raise ValueError("too big")
        return x * 2

    with Spy(), pytest.warns(RuntimeWarning), pytest.raises(InstanceError) as info:
        autobatch(f)([torch.ones(2), torch.full((2,), 99.0)])
    assert info.value.instance == 1 and "too big" in str(info.value)
