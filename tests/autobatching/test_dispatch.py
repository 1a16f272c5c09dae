"""torch.nn.functional's Python functions inside autobatch: the direct dispatch (dispatch.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.overrides
from torch import nn
from torch.overrides import TorchFunctionMode

from batchcraft import autobatch
from batchcraft.autobatching.dispatch import FAST_DISPATCH
from equivalence import CORES, assert_matches_eager

D = 6


@pytest.mark.parametrize("core", CORES)
def test_functional_modules_match_eager_and_record_as_before(core):
    torch.manual_seed(0)
    emb = nn.Embedding(10, D, padding_idx=0)
    ln = nn.LayerNorm(D)
    lin = nn.Linear(D, 4)

    def fn(inst):
        x, w = inst
        h = F.relu(ln(x + emb(torch.tensor(w))))
        h = F.dropout(h, 0.5, training=False)
        logits = lin(F.gelu(h))
        return F.log_softmax(logits, -1), F.cross_entropy(logits.unsqueeze(0), torch.tensor([w % 4]))

    insts = [(torch.randn(D), w) for w in (0, 3, 7, 3, 9)]
    params = [*emb.parameters(), *ln.parameters(), *lin.parameters()]
    fast = assert_matches_eager(fn, insts, params, core=core)
    slow = assert_matches_eager(fn, insts, params, core=core, fast_modules=False)
    assert fast.stats.ops_recorded == slow.stats.ops_recorded  # the same operations, reached directly
    assert fast.stats.fallbacks == 0
    assert F.handle_torch_function is torch.overrides.handle_torch_function


def test_a_users_mode_inside_the_instance_still_sees_functional_calls():
    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def fn(x):
        with Count():
            return F.relu(x) + 1

    xs = [torch.randn(3) for _ in range(3)]
    outs = autobatch(fn)(xs)
    for o, x in zip(outs, xs):
        torch.testing.assert_close(o, torch.relu(x) + 1)
    assert "relu" in seen


def test_calls_outside_recording_take_torchs_path():
    class Tagged(torch.Tensor):  # a subclass with its own __torch_function__
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls += 1
            return super().__torch_function__(func, types, args, kwargs)

    t = torch.randn(4).as_subclass(Tagged)
    with FAST_DISPATCH:  # as while another thread's call records
        assert F.handle_torch_function is not torch.overrides.handle_torch_function
        out = F.relu(t)
    assert Tagged.calls >= 1 and torch.equal(out.as_subclass(torch.Tensor), torch.relu(t.as_subclass(torch.Tensor)))
    assert F.handle_torch_function is torch.overrides.handle_torch_function
