"""``torch.tensor`` while the C core records with ``fast_factories=True`` (ccore.FAST_FACTORIES):
the same results as the mode path. Opt-in because the replacement is process-wide."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from batchcraft import autobatch
from batchcraft.autobatching import _native

pytestmark = pytest.mark.skipif(not _native.available, reason="the C core was not built")
ORIGINAL = torch.tensor


def test_installed_only_while_a_call_records_and_removed_after_errors():
    seen = []

    def f(x):
        seen.append(torch.tensor is _native.core.fast_tensor)
        if x.sum() > 10:
            raise ValueError("boom")
        return x * torch.tensor(2.0)

    autobatch(f, core="c", fast_factories=True)([torch.ones(2)])
    assert seen == [True] and torch.tensor is ORIGINAL
    with pytest.raises(Exception, match="boom"):
        autobatch(f, core="c", fast_factories=True)([torch.full((2,), 20.0)])
    assert torch.tensor is ORIGINAL
    autobatch(f, core="python", fast_factories=True)([torch.ones(2)])
    assert seen[-1] is False  # the Python core does not install it
    autobatch(f, core="c")([torch.ones(2)])
    assert seen[-1] is False  # opt-in: not installed by default


@pytest.mark.parametrize("kw", [{}, {"dtype": torch.float64}, {"device": "cpu"}, {"dtype": torch.bool},
                                {"device": torch.device("cpu"), "dtype": torch.float16}, {"requires_grad": True}])
@pytest.mark.parametrize("v", [3, -2.5, True])
def test_scalar_factories_equal_eager(v, kw):
    if kw.get("requires_grad") and not isinstance(v, float):
        pytest.skip("only floating tensors can require grad")

    def f(x):
        t = torch.tensor(v, **kw)
        return t, t.dtype, t.requires_grad

    xs = [torch.ones(1) for _ in range(3)]
    for out in autobatch(f, core="c", fast_factories=True)(xs):
        ref = f(xs[0])
        assert out[1] == ref[1] and out[2] == ref[2]
        torch.testing.assert_close(out[0], ref[0])


def test_other_threads_and_other_modes_get_torch_tensor_as_usual():
    from_thread = []
    seen_by_mode = []
    go, done = threading.Event(), threading.Event()

    def other():
        go.wait(10)
        from_thread.append(torch.tensor(7))
        done.set()

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen_by_mode.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    def f(x):
        go.set()
        done.wait(10)  # the other thread calls torch.tensor while this call records
        with Spy():
            a = torch.tensor(1.5)  # instance code's own mode sees it first, as in eager
        with torch._C.DisableTorchFunction():
            b = torch.tensor(2.5)  # no mode at all: a real tensor, as in eager
        return x + a + b

    t = threading.Thread(target=other)
    t.start()
    out = autobatch(f, core="c", fast_factories=True)([torch.zeros(1)])
    t.join()
    assert type(from_thread[0]) is torch.Tensor and from_thread[0].item() == 7
    assert "tensor" in seen_by_mode
    torch.testing.assert_close(out[0], torch.tensor([4.0]))


def test_concurrent_calls_share_one_installation():
    barrier = threading.Barrier(2)
    results, errors = [], []

    def f(x):
        return x * torch.tensor(3.0)

    def worker():
        try:
            barrier.wait(10)
            for _ in range(20):
                results.append(autobatch(f, core="c", fast_factories=True)([torch.ones(2)])[0])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(results) == 40
    assert all(torch.equal(r, torch.full((2,), 3.0)) for r in results)
    assert torch.tensor is ORIGINAL
