"""Metadata reads of plain tensors while calls record (tensormeta.py): eager's answers, eager's
dispatch where anyone else would see the read, and torch's class left as it was."""

import threading

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from batchcraft.autobatching import autobatch
from batchcraft.autobatching._native import core as _c
from batchcraft.autobatching.tensormeta import NAMES

from equivalence import CORES

needs_c = pytest.mark.skipif(_c is None, reason="no C core built")


def _meta(t):
    return tuple(getattr(t, n) for n in NAMES)


@pytest.mark.parametrize("core", CORES)
def test_parameter_and_tensor_metadata_read_in_instance_code_is_eagers(core):
    lin = nn.Linear(3, 2)
    frozen = torch.ones(4, dtype=torch.float64)

    def fn(x):
        reads = (_meta(lin.weight), _meta(lin.bias), _meta(frozen))
        return lin(x).to(frozen.dtype) * frozen[:2], reads

    xs = [torch.randn(3) for _ in range(3)]
    ref = [fn(x) for x in xs]
    out = autobatch(fn, core=core)(xs)
    for (o, r_reads), (e, e_reads) in zip(out, ref):
        assert r_reads == e_reads
        torch.testing.assert_close(o, e)
    assert not any(n in vars(torch.Tensor) for n in NAMES)  # torch's class as it was


@needs_c
def test_the_class_attribute_reads_as_torchs_descriptor_during_the_call():
    seen = []

    def fn(x):
        seen.append([torch.Tensor.__dict__.get("device"), torch.Tensor.device])
        return x * 2

    autobatch(fn, core="c")([torch.ones(2)])
    patched, read = seen[0]
    assert type(patched).__name__ == "TensorMeta"  # installed while the call records ...
    assert read is torch._C.TensorBase.__dict__["device"]  # ... and read on the class as torch's own
    assert "device" not in vars(torch.Tensor)


@pytest.mark.parametrize("core", CORES)
def test_a_users_mode_in_instance_code_sees_the_reads_as_in_eager(core):
    w = nn.Parameter(torch.ones(3))

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def fn(x):
        with Count() as c:
            w.device, w.shape, w.dtype
        return x + 1, sorted(c.names)

    ref = [fn(torch.zeros(3))[1]]
    out = autobatch(fn, core=core)([torch.zeros(3)])
    assert [o[1] for o in out] == ref and ref[0]  # the mode saw the same reads


@pytest.mark.parametrize("core", CORES)
def test_a_subclass_handler_sees_its_metadata_reads(core):
    seen = []

    class Tagged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func == torch.Tensor.device.__get__:  # (a new method-wrapper at each read)
                seen.append("device")
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(2).as_subclass(Tagged)

    def fn(x):
        t.device
        return x * 2

    fn(torch.ones(2))
    eager = len(seen)
    autobatch(fn, core=core)([torch.ones(2)])
    assert eager == 1 and len(seen) == 2


@pytest.mark.parametrize("core", CORES)
def test_a_default_device_set_inside_instance_code_stays_below_the_mode(core):
    # found by this module's first version: with torch.set_default_device's DeviceContext below
    # the recording mode, the mode off the stack left that context alone there, and a read
    # popped it and pushed the mode twice
    w = nn.Parameter(torch.ones(2))

    def fn(i):
        torch.set_default_device("meta")
        try:
            dev = w.device
            return torch.zeros(2) + i, dev
        finally:
            torch.set_default_device(None)

    out = autobatch(fn, core=core)([1, 2])
    assert [o[1] for o in out] == [torch.device("cpu")] * 2
    assert [o[0].device.type for o in out] == ["meta"] * 2
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("core", CORES)
def test_another_thread_reads_plainly_while_a_call_records(core):
    w = torch.ones(2, 3)
    started, done = threading.Event(), threading.Event()
    other = []

    def reader():
        started.wait(10)
        other.append(_meta(w))
        done.set()

    th = threading.Thread(target=reader)
    th.start()

    def fn(x):
        started.set()
        done.wait(10)
        return x * 2

    autobatch(fn, core=core)([torch.ones(2)])
    th.join(10)
    assert other == [_meta(w)]
