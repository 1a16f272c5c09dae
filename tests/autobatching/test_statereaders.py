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


def test_autocast_keys_tell_apart_what_changes_results_and_nothing_else():
    keys = statereaders.AutocastKeys({"cpu": 0b01, "cuda": 0b10})
    prev = torch.get_autocast_dtype("cpu"), torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled()
    try:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        bf16 = keys(0b01)
        assert keys(0b01) == bf16 and keys(0b11) != bf16  # the same state; a second device on
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        assert keys(0b01) == bf16  # a device that is off casts nothing: its dtype is not part of the key
        assert keys(0b11) not in (bf16, None)
        torch.set_autocast_dtype("cpu", torch.float16)
        assert keys(0b01) not in (bf16, None)
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        torch.set_autocast_cache_enabled(False)
        assert keys(0b01) not in (bf16, None)
    finally:
        torch.set_autocast_dtype("cpu", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])
        torch.set_autocast_cache_enabled(prev[2])
    want = keys(0b01)
    again = statereaders.AutocastKeys({"cpu": 0b01, "cuda": 0b10})  # (install may run again)
    again(0b11)
    assert again(0b01) == want  # an id keeps its meaning for the process: the core's table outlives both
    full = statereaders.AutocastKeys({"cpu": 1})
    known = full(1)
    full.MAX_KEYS = 0
    assert full(1) == known and full(0) is None  # past MAX_KEYS: known states keep their ids, new ones get none


def test_learnt_bits_name_each_counted_device(reinstall):
    if not core.state_readers_on()[1]:
        pytest.skip("no autocast reader on this platform")
    mask, off, bits = statereaders.learn_autocast_bits(core.dispatch_key_words)
    assert "cpu" in bits and sum(bits.values()) == mask  # one bit each, together the mask
    for device, bit in bits.items():
        assert bit & (bit - 1) == 0
        with _on(device):  # (torch.autocast("cuda") turns itself off without CUDA)
            assert (core.dispatch_key_words()[1] ^ off) & mask == bit


class _on:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        torch.set_autocast_enabled(self.device, True)

    def __exit__(self, *exc):
        torch.set_autocast_enabled(self.device, False)
