"""torch's C++ state accessors in the C core (statereaders.py): found, checked, refused when wrong."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

from batchcraft import autobatch, static_block
from batchcraft.autobatching import _native, statereaders

core = _native.core
pytestmark = pytest.mark.skipif(core is None, reason="the C extension is not built")
#: BATCHCRAFT_STATE_READERS=0: the process keeps torch's builtins (the tests below put that back)
READERS_ON = os.environ.get("BATCHCRAFT_STATE_READERS", "1") != "0"


@pytest.fixture
def reinstall():
    """Whatever a test sets, the process gets the checked readers back."""
    yield
    core.set_state_readers(None)
    core.set_autocast_reader(None)
    if READERS_ON:
        statereaders.install(core)


def test_in_use_here_and_agreeing_with_torch():
    found = statereaders.find()
    if not READERS_ON:
        pytest.skip("BATCHCRAFT_STATE_READERS=0")
    if found is None:
        pytest.skip("this torch build does not export the accessors")
    assert core.state_readers_on()[0]
    assert statereaders.agrees(core)
    assert core.read_state() == statereaders.builtin_state()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_autocast_read_from_the_dispatch_keys(device):
    if not core.state_readers_on()[1]:
        pytest.skip("no autocast reader on this platform")
    assert not core.any_autocast()
    torch.set_autocast_enabled(device, True)
    try:
        assert core.any_autocast() and torch._C._is_any_autocast_enabled()
        seen = []
        t = threading.Thread(target=lambda: seen.append(core.any_autocast()))  # thread-local: off there
        t.start()
        t.join()
        assert seen == [False]
    finally:
        torch.set_autocast_enabled(device, False)
    assert not core.any_autocast()


def test_a_wrong_reader_is_refused(reinstall):
    found = statereaders.find()
    if found is None:
        pytest.skip("this torch build does not export the accessors")
    grad, inference, *rest = found
    core.set_state_readers((inference, grad, *rest))  # grad mode read as inference mode
    assert not statereaders.agrees(core)


def test_install_falls_back_to_the_builtins_when_the_check_fails(monkeypatch, reinstall):
    found = statereaders.find()
    if found is None:
        pytest.skip("this torch build does not export the accessors")
    grad, inference, *rest = found
    monkeypatch.setattr(statereaders, "find", lambda: (inference, grad, *rest))
    assert statereaders.install(core) is False
    assert core.state_readers_on() == (False, False)
    assert core.read_state() == statereaders.builtin_state()  # the builtins answer


def test_missing_symbols_keep_the_builtins(monkeypatch, reinstall):
    monkeypatch.setattr(statereaders, "SYMBOLS", statereaders.SYMBOLS[:-1] + (("c10", "_no_such_symbol"),))
    assert statereaders.find() is None
    core.set_state_readers(None)
    assert statereaders.install(core) is False
    assert core.state_readers_on()[0] is False


def test_autocast_bits_that_are_not_one_bit_a_device_are_refused():
    words = iter([(0, 0), (0, 0b11)] + [(0, 0)] * 100)
    assert statereaders.learn_autocast_bits(lambda: next(words)) is None
    moved_included = iter([(0, 0), (1, 0b1)] + [(0, 0)] * 100)
    assert statereaders.learn_autocast_bits(lambda: next(moved_included)) is None


@static_block
def _cell(x, w):
    return torch.tanh(x @ w)


def _per_instance(w):
    def fn(x):
        h = _cell(x, w)
        with torch.no_grad():
            k = _cell(h, w)  # a block under no_grad inside instance code: its own signature
        return h + k
    return fn


@pytest.mark.parametrize("readers", [True, False])
def test_recording_is_eager_with_and_without_the_readers(readers, reinstall):
    if not readers:
        core.set_state_readers(None)
        core.set_autocast_reader(None)
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 6) * 0.3)
    xs = [torch.randn(6) for _ in range(5)]
    fn = _per_instance(w)
    ref = [fn(x) for x in xs]
    ref_g = torch.autograd.grad(sum(r.sum() for r in ref), w)[0]
    out = autobatch(fn)(xs)
    g = torch.autograd.grad(sum(o.sum() for o in out), w)[0]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
        assert o.requires_grad == r.requires_grad
    torch.testing.assert_close(g, ref_g)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast seen: the slow path, as eager
        ref_ac = [fn(x) for x in xs]
        out_ac = autobatch(fn)(xs)
    for o, r in zip(out_ac, ref_ac):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r)
