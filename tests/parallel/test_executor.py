"""The inter-op executor equals eager PyTorch: values, gradients, grad mode, threads, errors."""

import threading

import pytest
import torch
import torch.fx
from hypothesis import given, settings, strategies as st
from torch import nn

from batchcraft import models
from batchcraft.errors import ConfigurationError
from batchcraft.parallel import InterOpExecutor

_SEEN_THREADS: list[tuple[str, int]] = []


@torch.fx.wrap
def record_threads(x):
    _SEEN_THREADS.append((threading.current_thread().name, torch.get_num_threads()))
    return x


class Wide(nn.Module):
    def __init__(self, depths, dim=16):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(*[m for _ in range(d) for m in (nn.Linear(dim, dim), nn.GELU())]) for d in depths)
        self.out = nn.Linear(dim * len(depths), 3)

    def forward(self, x):
        return self.out(torch.cat([b(x) for b in self.branches], dim=1))


@pytest.mark.parametrize("name", ["inception_wide", "recommender", "mlp_fc512"])
@pytest.mark.parametrize("pools", [2, 3])
def test_equals_eager_on_registry_models(name, pools):
    torch.manual_seed(0)
    kwargs = {"blocks": 2, "branch": 8, "image_size": 12} if name == "inception_wide" else {}
    if name == "recommender":
        kwargs = {"vocab": 50}
    model = models.get(name, **kwargs).eval()
    x = model.example_input(4)
    with torch.no_grad(), InterOpExecutor(model, inter_op_threads=pools, intra_op_threads=1) as run:
        ref = model(x)
        for _ in range(3):  # repeated calls reuse the pool
            torch.testing.assert_close(run(x), ref, rtol=1e-6, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(depths=st.lists(st.integers(1, 3), min_size=1, max_size=5), batch=st.integers(1, 6),
       pools=st.integers(1, 4))
def test_values_and_gradients_equal_eager(depths, batch, pools):
    torch.manual_seed(len(depths))
    model = Wide(depths)
    x = torch.randn(batch, 16, requires_grad=True)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    with InterOpExecutor(model, inter_op_threads=pools, intra_op_threads=1) as run:
        out = run(x)
        out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip([p.grad for p in model.parameters()] + [x.grad], ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_caller_grad_mode_reaches_pool_threads():
    model = Wide([2, 2])
    x = torch.randn(2, 16)
    with InterOpExecutor(model, inter_op_threads=2) as run:
        assert run(x).requires_grad
        with torch.no_grad():
            assert not run(x).requires_grad
        with torch.inference_mode():
            assert run(x).is_inference()


def test_pool_threads_use_intra_op_threads_and_caller_count_is_kept():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return record_threads(self.a(x)) + record_threads(self.b(x))

    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    _SEEN_THREADS.clear()
    with InterOpExecutor(Two(), inter_op_threads=2, intra_op_threads=other) as run:
        assert torch.get_num_threads() == before
        run(torch.randn(3, 4))
    assert len(_SEEN_THREADS) == 2
    assert all(name.startswith("batchcraft-interop") and n == other for name, n in _SEEN_THREADS)
    assert torch.get_num_threads() == before


def test_error_names_the_node():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(5, 4)

        def forward(self, x):
            return self.a(x) + self.b(x)

    with InterOpExecutor(Bad(), inter_op_threads=2) as run:
        with pytest.raises(RuntimeError) as info:
            run(torch.randn(2, 4))
    assert "node 'b'" in "\n".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("kwargs", [{"inter_op_threads": 0}, {"inter_op_threads": 2, "intra_op_threads": 0}])
def test_bad_thread_counts(kwargs):
    with pytest.raises(ConfigurationError, match="must be an int >= 1"):
        InterOpExecutor(Wide([1]), **kwargs)


def test_in_place_updates_keep_eager_order_with_other_readers():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.a(x)
            early = self.b(h)        # reads h before the in-place ReLU
            self.relu(h)             # eager order: after `early`, before `late`
            h.mul_(2.0)
            late = self.c(h)         # reads the updated h
            return early + late

    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(2048, 256)
    with torch.no_grad():
        ref = model(x)
        with InterOpExecutor(model, inter_op_threads=3, intra_op_threads=1) as run:
            for _ in range(20):  # a race would show up on some run
                torch.testing.assert_close(run(x), ref, rtol=0, atol=0)


# -- the caller's thread-local state in the pool threads (issue 15, item 5) ----------------------

_VAR = __import__("contextvars").ContextVar("batchcraft_test_var", default="unset")
_SEEN_VARS: list[str] = []
_SEEN_AUTOCAST: list[tuple] = []


@torch.fx.wrap
def record_state(x):
    _SEEN_VARS.append(_VAR.get())
    _SEEN_AUTOCAST.append((threading.current_thread().name, torch.is_autocast_enabled("cpu"),
                           torch.get_autocast_dtype("cpu")))
    return x


@torch.fx.wrap
def plus_ones(x):
    return x + torch.ones(x.shape[-1]).to(x.dtype), torch.ones(1).dtype  # a factory call: default dtype


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.c(record_state(self.a(x)) + record_state(self.b(x)))


def _caller_state():
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_autocast_region_gives_the_dtype_and_values_of_eager(dtype):
    torch.manual_seed(0)
    model, x = Branches(), torch.randn(4, 16)
    with InterOpExecutor(model, inter_op_threads=2, intra_op_threads=1) as run:
        before = _caller_state()
        with torch.autocast("cpu", dtype=dtype):
            ref = model(x)
            _SEEN_AUTOCAST.clear()
            out = run(x)
            seen = list(_SEEN_AUTOCAST)
        assert _caller_state() == before  # nothing leaks into the caller's thread
        plain = run(x)  # after the region: float32 again, in the pool threads too
    assert ref.dtype == dtype and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert plain.dtype == torch.float32
    assert {s[1:] for s in seen} == {(True, dtype)}
    assert any(name.startswith("batchcraft-interop") for name, *_ in seen)


def test_grad_inference_and_no_grad_modes_match_eager_in_every_combination():
    model, x = Branches(), torch.randn(3, 16)
    with InterOpExecutor(model, inter_op_threads=3) as run:
        for ctx in (torch.enable_grad, torch.no_grad, torch.inference_mode):
            with ctx():
                ref, out = model(x), run(x)
            assert (out.requires_grad, out.is_inference()) == (ref.requires_grad, ref.is_inference()), ctx
            torch.testing.assert_close(out, ref)


def test_torch_function_modes_and_context_variables_reach_pool_threads():
    from torch.overrides import TorchFunctionMode

    class CountLinear(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls, self.lock = 0, threading.Lock()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear:
                with self.lock:
                    self.calls += 1
            return func(*args, **(kwargs or {}))

    model, x = Branches(), torch.randn(2, 16)
    with InterOpExecutor(model, inter_op_threads=2) as run:
        eager_mode, pooled_mode = CountLinear(), CountLinear()
        with eager_mode:
            model(x)
        with pooled_mode:
            run(x)
        assert pooled_mode.calls == eager_mode.calls == 3
        token = _VAR.set("from the caller")
        try:
            _SEEN_VARS.clear()
            run(x)
        finally:
            _VAR.reset(token)
        assert _SEEN_VARS == ["from the caller"] * 2
        run(x)  # the modes were popped again in the pool threads
        assert pooled_mode.calls == 3


def test_the_default_dtype_is_the_callers():
    class Factory(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            ya, da = plus_ones(self.a(x))
            yb, db = plus_ones(self.b(x))
            return ya + yb, da, db

    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        model = Factory()
        x = torch.randn(2, 16)
        with InterOpExecutor(model, inter_op_threads=2) as run:
            out, ref = run(x), model(x)
    finally:
        torch.set_default_dtype(saved)
    assert out[1:] == ref[1:] == (torch.float64, torch.float64)
    torch.testing.assert_close(out[0], ref[0])
