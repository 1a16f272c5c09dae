"""A default device set around the call (``torch.set_default_device``, ``with torch.device(...)``).

torch's ``DeviceContext`` mode adds ``device=`` to factory calls. The recording mode sits above it
and makes per-instance factory leaves itself, so it must place them where eager would: before,
``torch.tensor(word_id)`` under ``torch.set_default_device("cuda")`` made a CPU leaf and the batched
run failed (or ran on the wrong device) where eager ran on the GPU. On the CPU-only CI the
``meta`` device stands in for the GPU: eager and batched outputs must agree in device, shape and
dtype (meta tensors hold no values; ``test_gpu.py`` compares values on CUDA).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch, static_block
from batchcraft.autobatching.devices import factory_device
from equivalence import CORES


class Cell(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, kids):
        h = torch.zeros(x.shape[-1])                      # a factory inside a static block
        if kids:
            h = torch.stack(kids, dim=-2).sum(-2)
        return torch.tanh(self.lin(x) + h)


def _program(emb, cell):
    def fn(inst):
        ids, n = inst
        k = torch.tensor(2.0)                              # scalar leaf (C fast path without a device)
        z = torch.zeros(emb.embedding_dim)                 # fill factory (C fast path)
        r = torch.arange(emb.embedding_dim).float()        # general factory
        o = torch.ones(emb.embedding_dim, dtype=torch.float32) * n
        kids = []
        for i in ids:
            kids = [cell(emb(torch.tensor(i)), kids)]
        return kids[0] * k + z + r + o, torch.full((2,), 0.5)
    return fn


def _instances():
    return [([1, 4, 2], 1), ([3], 2), ([0, 5], 3)]


def _check_like(out, ref, device):
    for (a, b), (ra, rb) in zip(out, ref):
        for t, r in ((a, ra), (b, rb)):
            assert t.device == r.device == device
            assert t.shape == r.shape and t.dtype == r.dtype


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("how", ["context", "set_default_device"])
def test_factories_follow_the_default_device(core, how):
    dev = torch.device("meta")
    if how == "context":
        ctx = torch.device("meta")
    else:
        class _Set:
            def __enter__(self):
                torch.set_default_device("meta")

            def __exit__(self, *exc):
                torch.set_default_device(None)
        ctx = _Set()
    with ctx:
        torch.manual_seed(0)
        emb, cell = nn.Embedding(8, 6), static_block(Cell(6))
        fn = _program(emb, cell)
        ref = [fn(x) for x in _instances()]
        f = autobatch(fn, core=core)
        out = f(_instances())
        _check_like(out, ref, dev)
        assert f.stats.fallbacks == 0
    assert factory_device() is None  # the context is gone afterwards


@pytest.mark.parametrize("core", CORES)
def test_explicit_device_wins_over_the_default(core):
    with torch.device("meta"):
        f = autobatch(lambda x: torch.tensor(3.0, device="cpu") + torch.zeros(2, device="cpu") + x, core=core)
        out = f([torch.ones(2, device="cpu")])
    assert out[0].device.type == "cpu"
    torch.testing.assert_close(out[0], torch.full((2,), 4.0))


@pytest.mark.parametrize("core", CORES)
def test_cpu_default_keeps_the_fast_paths(core):
    # set_default_device("cpu") pushes a DeviceContext too: CPU leaves as without it, values equal eager
    with torch.device("cpu"):
        assert factory_device() == torch.device("cpu")
        f = autobatch(lambda i: torch.tensor(i) * 2 + torch.zeros(1, dtype=torch.int64), core=core)
        out = f([1, 2, 3])
    assert [int(o) for o in out] == [2, 4, 6]


def test_innermost_device_context_wins():
    with torch.device("meta"):
        with torch.device("cpu"):
            assert factory_device() == torch.device("cpu")
        assert factory_device() == torch.device("meta")
    assert factory_device() is None


@pytest.mark.skipif("c" not in CORES, reason="the C core is not built")
@pytest.mark.parametrize("how", ["explicit", "default"])
def test_scalar_leaves_on_a_device_take_the_c_path(how, monkeypatch):
    """``torch.tensor(word_id, device=d)`` (TreeLSTM on a GPU) and ``torch.tensor(word_id)`` under a
    default device go to Python once per (device, dtype), then stay in C (they used to run eagerly,
    one synchronous host-to-device copy each)."""
    from batchcraft.autobatching.ccore import CRecorder

    calls = []
    orig = CRecorder.mode_call
    monkeypatch.setattr(CRecorder, "mode_call", lambda self, *a: calls.append(a[0]) or orig(self, *a))
    dev = torch.device("meta")

    def fn(n):
        if how == "explicit":
            xs = [torch.tensor(i, device=dev) for i in range(n)] + [torch.tensor(0.5 * i, device=dev) for i in range(n)]
        else:
            xs = [torch.tensor(i) for i in range(n)] + [torch.tensor(0.5 * i) for i in range(n)]
        return torch.stack([x.float() for x in xs]).sum()

    ctx = torch.device("meta") if how == "default" else torch.device("cpu")
    with ctx:
        f = autobatch(fn, core="c")
        out = f([20, 30])
    assert all(o.device == dev and o.shape == () for o in out)
    assert calls.count(torch.tensor) == 2  # int64 and float32 on meta: once each


# -- found by a hostile run of the feature (stop 29) -----------------------------------------------

@pytest.mark.parametrize("core", CORES)
def test_set_default_device_inside_instance_code(core):
    """torch.set_default_device inside instance code puts its DeviceContext below the recording
    mode: the recorder reads it again (it used to keep the device of the call's start)."""
    def fn(i):
        torch.set_default_device("meta")
        try:
            return torch.tensor(i) + torch.zeros(2)
        finally:
            torch.set_default_device(None)

    before = torch.get_default_device()
    ref = [fn(i) for i in (1, 2, 3)]
    out = autobatch(fn, core=core)([1, 2, 3])
    assert [o.device.type for o in out] == [r.device.type for r in ref] == ["meta"] * 3
    assert torch.get_default_device() == before and factory_device() is None


@pytest.mark.parametrize("core", CORES)
def test_one_fiber_setting_a_default_device_leaves_the_others_theirs(core):
    def fn(i):
        if i % 2:
            torch.set_default_device("meta")
        k = torch.tensor(float(i))
        bool(torch.tensor(float(i), device="cpu") * 2 > -1)  # a value wait: the fibers interleave here
        z = torch.zeros(2)
        if i % 2:
            torch.set_default_device(None)
        return k + z

    f = autobatch(fn, core=core)
    out = f([0, 1, 2, 3])
    assert f.stats.syncs >= 1
    assert [o.device.type for o in out] == ["cpu", "meta", "cpu", "meta"]
    assert factory_device() is None and torch.get_default_device().type == "cpu"
    torch.testing.assert_close(out[2], torch.full((2,), 2.0))


@pytest.mark.parametrize("core", CORES)
def test_block_traced_under_another_default_device_is_traced_again(core):
    @static_block
    def blk(x):
        return x.sum() + torch.zeros(3)

    xs = [torch.ones(2), torch.ones(2) * 2]
    f = autobatch(lambda x: blk(x), core=core)
    f(xs)  # traced without a default device
    with torch.device("meta"):
        assert [o.device.type for o in f(xs)] == ["meta", "meta"]  # eager: zeros(3) on meta
    torch.testing.assert_close(f(xs)[1], torch.full((3,), 4.0))  # and back


@pytest.mark.parametrize("core", CORES)
def test_a_cpu_default_device_moves_tensor_data_as_eager(core):
    """``DeviceContext("cpu")`` adds device="cpu" too: ``torch.as_tensor(x)`` copies x's data to the
    CPU (on meta that fails, in eager and batched alike; on a GPU it makes a CPU tensor)."""
    fn = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    xs = [torch.ones(2, device="meta"), torch.zeros(2, device="meta")]
    with torch.device("cpu"):
        with pytest.raises(NotImplementedError):
            fn(xs[0])
        with pytest.raises(Exception, match="meta"):
            autobatch(fn, core=core)(xs)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("dtype,value", [(torch.int8, 300), (torch.int16, 40000), (torch.int32, 2 ** 40),
                                         (torch.int64, 1e30), (torch.int64, float("nan"))])
def test_scalar_leaf_of_a_narrow_dtype_overflows_as_eager(core, dtype, value):
    """``torch.tensor(300, dtype=torch.int8)`` raises in eager; the C core's buffer of scalar leaves
    was cast and wrapped (300 -> 44) instead."""
    fn = lambda v: torch.tensor(v, dtype=dtype) + 0  # noqa: E731
    with pytest.raises(RuntimeError, match="overflow"):
        fn(value)
    with pytest.raises(Exception, match="overflow"):
        autobatch(fn, core=core)([1, value])
    assert [int(o) for o in autobatch(fn, core=core)([1, 2])] == [1, 2]
