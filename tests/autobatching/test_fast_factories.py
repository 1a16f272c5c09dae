"""``torch.tensor`` while the C core records with ``fast_factories=True`` (the default;
ccore.FAST_FACTORIES): the same results as the mode path, and every reader other than the
recording thread with its mode innermost sees the real ``torch.tensor`` object (reliability #36)."""

from __future__ import annotations

import threading
import types
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode

from batchcraft import autobatch
from batchcraft.autobatching import _native

from equivalence import NameLog

pytestmark = pytest.mark.skipif(not _native.available, reason="the C core was not built")
ORIGINAL = torch.tensor


def test_installed_only_while_a_call_records_and_removed_after_errors():
    seen = []

    def f(x):
        seen.append(torch.tensor is _native.core.fast_tensor)
        if x.sum() > 10:
            raise ValueError("boom")
        return x * torch.tensor(2.0)

    autobatch(f, core="c")([torch.ones(2)])  # the default
    assert seen == [True] and torch.tensor is ORIGINAL and type(torch) is types.ModuleType
    with pytest.raises(Exception, match="boom"):
        autobatch(f, core="c", fast_factories=True)([torch.full((2,), 20.0)])
    assert torch.tensor is ORIGINAL and type(torch) is types.ModuleType
    autobatch(f, core="python", fast_factories=True)([torch.ones(2)])
    assert seen[-1] is False  # the Python core does not install it
    autobatch(f, core="c", fast_factories=False)([torch.ones(2)])
    assert seen[-1] is False
    assert vars(torch)["tensor"] is ORIGINAL


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


def test_a_mode_in_another_thread_that_tests_func_is_torch_tensor_still_matches():
    # reliability #36: with torch.tensor replaced process-wide, such a mode in an unrelated thread
    # stopped matching; now only the recording thread reads the fast function
    matched, during = [], []
    go, done = threading.Event(), threading.Event()

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            matched.append(func is ORIGINAL)
            return func(*args, **(kwargs or {}))

    def other():
        go.wait(10)
        during.append(torch.tensor is ORIGINAL)
        with Count():
            for i in range(50):
                torch.tensor(i)
        done.set()

    def f(x):
        go.set()
        done.wait(10)
        return x * torch.tensor(2.0)

    t = threading.Thread(target=other)
    t.start()
    out = autobatch(f, core="c")([torch.ones(1), torch.ones(1)])
    t.join()
    assert during == [True] and len(matched) == 50 and all(matched)
    assert all(torch.equal(o, torch.tensor([2.0])) for o in out)


def test_a_mode_of_the_instance_code_gets_the_real_torch_tensor_as_func():
    funcs = []

    def f(x):
        with NameLog(funcs):
            inside = torch.tensor is ORIGINAL  # a mode of the user's is innermost
            a = torch.tensor(1.5)
        return x + a, inside

    out = autobatch(f, core="c")([torch.zeros(1)])
    assert out[0][1] is True and funcs and funcs[0] is ORIGINAL
    torch.testing.assert_close(out[0][0], torch.tensor([1.5]))


def test_mock_patch_of_torch_tensor_around_and_inside_the_call():
    made = []

    def fake(v, **kw):
        made.append(v)
        return ORIGINAL(v, **kw) * 10

    def f(x):
        return x * torch.tensor(2.0)

    with mock.patch.object(torch, "tensor", fake):  # spans the call: instance code sees the patch
        out = autobatch(f, core="c")([torch.ones(1)])
    assert made == [2.0] and torch.equal(out[0], torch.tensor([20.0])) and torch.tensor is ORIGINAL

    def g(x):
        with mock.patch.object(torch, "tensor", fake):  # set while recording
            a = torch.tensor(3.0)
        return x * a * torch.tensor(1.0)

    out = autobatch(g, core="c")([torch.ones(1)])
    assert made[-1] == 3.0 and torch.equal(out[0], torch.tensor([30.0]))
    assert torch.tensor is ORIGINAL and vars(torch)["tensor"] is ORIGINAL and type(torch) is types.ModuleType


def test_torch_device_context_still_knows_torch_tensor_after_calls():
    from torch.utils._device import _device_constructors

    def f(x):
        return x + torch.tensor(1.0)

    autobatch(f, core="c")([torch.zeros(1)])
    assert ORIGINAL in _device_constructors()
    with torch.device("meta"):
        assert torch.tensor(1.0).device.type == "meta"  # DeviceContext still adds device= to it
        out = autobatch(f, core="c")([torch.zeros(1, device="meta")])
    assert out[0].device.type == "meta"


def test_a_module_of_another_class_is_left_alone():
    from batchcraft.autobatching.patches import ModuleClassPatch

    class Mine(types.ModuleType):
        pass

    cls = type("module", (types.ModuleType,), {"__slots__": ()})
    mod = Mine("m")
    patch = ModuleClassPatch(mod, cls)
    with patch:
        assert type(mod) is Mine and not patch.active
    plain = types.ModuleType("p")
    patch = ModuleClassPatch(plain, cls)
    with patch:
        with patch:  # nested holders share one installation
            assert type(plain) is not types.ModuleType and patch.active
        assert patch.active
    assert type(plain) is types.ModuleType and not patch.active


def test_a_handler_of_a_mode_entered_in_instance_code_reads_the_real_torch_tensor():
    # torch takes the user's mode off the stack while its handler runs, so batchcraft's mode is
    # innermost there: the handler's own read of torch.tensor must still be the real one
    class ZeroFactories(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 0 if func is torch.tensor else out

    def f(x):
        with ZeroFactories():
            c = torch.tensor(5.0)
        return x + c

    xs = [torch.ones(2), torch.zeros(2)]
    out = autobatch(f, core="c")(xs)
    assert all(torch.equal(o, f(x)) for o, x in zip(out, xs))


def test_module_level_names_bound_during_a_call_keep_the_real_torch_tensor(tmp_path, monkeypatch):
    # a module first imported by instance code binds torch.tensor at its top level; it must not
    # keep the fast function after the call (identity checks, TorchScript)
    import sys

    (tmp_path / "bc_lazy_factories.py").write_text(
        "import torch\nfrom torch import tensor\nFACTORY = torch.tensor\n\n"
        "def add_one(x: torch.Tensor) -> torch.Tensor:\n    return x + tensor(1.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bc_lazy_factories", raising=False)

    def f(x):
        import bc_lazy_factories
        return bc_lazy_factories.add_one(x)

    out = autobatch(f, core="c")([torch.ones(2)])
    import bc_lazy_factories as m
    assert torch.equal(out[0], torch.full((2,), 2.0))
    assert m.tensor is ORIGINAL and m.FACTORY is ORIGINAL
    torch.jit.script(m.add_one)


def test_torchscript_inside_instance_code_sees_the_real_torch_tensor():
    def helper(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(3.0)

    compiled = []

    def f(x):
        if not compiled:  # compiled lazily on first use, while the call records
            compiled.append(torch.jit.script(helper))  # resolves torch.tensor from torch's frames
        return x * 2

    xs = [torch.ones(2), torch.zeros(2)]
    out = autobatch(f, core="c")(xs)
    assert all(torch.equal(o, x * 2) for o, x in zip(out, xs))
    assert torch.equal(compiled[0](torch.ones(2)), torch.full((2,), 3.0))


def test_the_fast_function_is_named_like_torch_tensor():
    # what instance code can still tell apart (documented): identity with a torch.tensor read
    # before the call; name, module and repr read as torch.tensor's
    names = []

    def f(x):
        t = torch.tensor
        names.append((t.__name__, t.__module__, t is ORIGINAL))
        return x

    autobatch(f, core="c")([torch.ones(1)])
    assert names == [("tensor", "torch", False)]
    autobatch(f, core="c", fast_factories=False)([torch.ones(1)])
    assert names[-1] == ("tensor", "torch", True)


def test_reads_from_a_handler_and_from_instance_code_alternate():
    # the C core remembers its verdict for the last function that read torch.tensor: a handler's
    # read between two of instance code's must still get the real function, and the next read of
    # instance code the fast one again
    seen, factories = [], []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(("handler", torch.tensor is ORIGINAL))
            factories.append(func is torch.tensor)
            return func(*args, **(kwargs or {}))

    def f(x):
        out = x
        for i in range(3):
            seen.append(("instance", torch.tensor is _native.core.fast_tensor))
            out = out + torch.tensor(float(i))
            with Spy():
                out = out + torch.tensor(1.0)
        return out

    xs = [torch.ones(2), torch.zeros(2)]
    out = autobatch(f, core="c")(xs)
    assert all(torch.equal(o, x + 6.0) for o, x in zip(out, xs))
    assert [s for s in seen if s[0] == "instance"] == [("instance", True)] * 6
    assert sum(s[0] == "handler" for s in seen) >= 6 and all(s[1] for s in seen if s[0] == "handler")
    assert sum(factories) == 6  # each instance's three torch.tensor calls inside the mode


def test_device_objects_equal_to_the_cpu_and_others():
    # the C core remembers the last device object found equal to the CPU (a model passes a new
    # `p.device` object per call); a device that is not the CPU's default still takes torch's path
    def f(x):
        outs = []
        for dev in (torch.device("cpu"), torch.device("cpu"), torch.device("cpu", 0), "cpu", torch.device("meta"),
                    torch.device("cpu")):
            t = torch.tensor(3.0, device=dev)
            outs.append((t.device, t.dtype))
            if t.device.type == "cpu":
                x = x + t
        return x, outs

    xs = [torch.ones(2), torch.zeros(2)]
    for (o, devs), x in zip(autobatch(f, core="c")(xs), xs):
        ref, ref_devs = f(x)
        assert torch.equal(o, ref) and devs == ref_devs


def test_the_innermost_frames_code_is_read_directly_on_python_3_11():
    # read_by_user_function asks for the code of the frame reading torch.tensor once per read;
    # on 3.11 the C core reads it from the interpreter frame (checked once against
    # PyEval_GetFrame) instead of making a frame object per function call
    import sys

    from batchcraft.autobatching import _native

    if _native.core is None:
        pytest.skip("no C core built")

    def fn(x):
        return torch.tensor(3) + x

    out = autobatch(fn, core="c")([torch.ones(2)])
    torch.testing.assert_close(out[0], torch.full((2,), 4.0))
    expected = 1 if sys.version_info[:2] == (3, 11) else 0
    assert _native.core.frame_reader() == expected
