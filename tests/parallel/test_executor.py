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
