"""Value requests of the recorder (recorder.py): Python scalars read after a wait.

``bool``, ``float``, ``int`` and ``.item()`` of a pending value wait for a flush; every waiting
instance then reads its row of the same batched result from one ``tolist()`` (``RecorderBase.scalar``).
These conversions must give exactly what eager's give, for every dtype and shape torch accepts, and
raise where eager raises.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchcraft import autobatch
from batchcraft.errors import InstanceError

from equivalence import CORES, NameLog

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.uint8, torch.bool]
CONVERSIONS = {"bool": bool, "float": float, "int": int, "item": lambda t: t.item()}


def _values(dtype):
    base = torch.tensor([0.0, -2.7, 3.5, 1e-3, 255.0, -0.0, 7.25, 100.5])
    return [base[i].to(dtype) for i in range(len(base))]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("conv", sorted(CONVERSIONS))
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=str)
def test_scalar_conversions_after_a_wait_match_eager(core, dtype, conv, shape):
    to = CONVERSIONS[conv]

    def fn(x):
        y = (x * 1).reshape(shape)  # a pending value: the conversion waits for a flush
        v = to(y)
        return torch.tensor(float(v)), type(v).__name__

    xs = _values(dtype)
    out = autobatch(fn, core=core)(xs)
    for (o, kind), x in zip(out, xs):
        r, rkind = fn(x)
        assert kind == rkind
        assert torch.equal(o, r), (o, r)


@pytest.mark.parametrize("core", CORES)
def test_int_of_a_float_nan_and_conversions_of_many_elements_raise_as_eager(core):
    def fn(x):
        return int(x * 1)

    for x in (torch.tensor(math.nan), torch.tensor(math.inf)):
        with pytest.raises(Exception) as eager:
            fn(x)
        with pytest.raises(InstanceError, match=type(eager.value).__name__):
            autobatch(fn, core=core)([torch.tensor(1.5), x])

    def two(x):
        return bool(x * 1)

    with pytest.raises(InstanceError, match="more than one"):
        autobatch(two, core=core)([torch.ones(2), torch.ones(2)])


@pytest.mark.parametrize("core", CORES)
def test_values_read_across_flushes_are_each_flush_own(core):
    # the rows converted after one flush must not be served after the next (the lists are dropped)
    def fn(x):
        h = x * 1
        seen = []
        for _ in range(4):
            h = h * 2 + 1
            seen.append(h.item())
            if bool(h > 1e6):
                break
        return torch.tensor(seen)

    xs = [torch.tensor(float(i)) for i in range(6)]
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        torch.testing.assert_close(o, fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("core", CORES)
def test_a_scalar_read_under_a_mode_of_the_user_goes_through_the_mode(core):
    # a TorchFunctionMode entered inside the instance sees the conversion, as in eager
    def fn(x):
        y = x * 2
        with NameLog() as m:
            v = y.item()
        return torch.tensor(v), "item" in m.names

    xs = [torch.tensor(1.0), torch.tensor(2.0)]
    out = autobatch(fn, core=core)(xs)
    for (o, saw), x in zip(out, xs):
        r, rsaw = fn(x)
        assert saw == rsaw
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("core", CORES)
def test_str_and_format_of_a_pending_value_match_eager(core):
    # hostile find (stop 35): f-strings printed "LazyTensor(...)" and f"{x:.2f}" raised
    def fn(x):
        s = (x * 2).sum()
        return s, [f"loss={s}", f"{s:.2f}", "{}".format(s), str(s), f"{x * 1}"]

    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    for (s, texts), x in zip(autobatch(fn, core=core)(xs), xs):
        assert texts == fn(x)[1]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fibers", [True, False])
def test_a_wait_inside_inference_mode_keeps_the_batched_work_out_of_it(core, fibers):
    # hostile find (stop 35): with fibers=False the flush ran in the instance's inference mode,
    # so values computed before it lost requires_grad and became inference tensors
    def fn(x):
        s = x * 2
        with torch.inference_mode():
            v = s[0].item()
        return s, v

    xs = [torch.tensor([1.0, 2.0], requires_grad=True) for _ in range(2)]
    for (s, v), x in zip(autobatch(fn, core=core, fibers=fibers)(xs), xs):
        rs, rv = fn(x)
        assert v == rv and s.requires_grad and not s.is_inference()
        torch.testing.assert_close(s, rs)
        (g,) = torch.autograd.grad(s.sum(), x, retain_graph=True)  # outputs of a call share a graph
        torch.testing.assert_close(g, torch.full((2,), 2.0))


@pytest.mark.parametrize("core", CORES)
def test_a_scalar_read_records_nothing(core, monkeypatch):
    # the first read of a batched result checked its shape with the recording mode on: each
    # metadata read went through the mode as a concrete op (DRNN small, batch 8: 4% slower)
    from batchcraft.autobatching import recorder

    calls = []
    real = recorder.RecorderBase.run_concrete

    def counting(self, *a, **k):
        calls.append(a[0])
        return real(self, *a, **k)

    monkeypatch.setattr(recorder.RecorderBase, "run_concrete", counting)

    def reads(x):
        y = x * 2
        return y + y.item()

    def no_read(x):
        y = x * 2
        return y + 1.0

    xs = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    autobatch(no_read, core=core)(xs)
    baseline = len(calls)
    calls.clear()
    out = autobatch(reads, core=core)(xs)
    assert len(calls) == baseline, calls
    assert [o.item() for o in out] == [4.0, 8.0, 12.0]


@pytest.mark.parametrize("core", CORES)
def test_printing_inside_a_static_block_still_traces(core, capsys):
    # a debugging print inside a block: no value exists while it is traced, so it prints the
    # lazy description instead of raising (the block still batches)
    from batchcraft import static_block

    @static_block
    def cell(x):
        y = torch.tanh(x)
        print(f"y={y}", str(y))
        return y * 2

    xs = [torch.randn(3) for _ in range(4)]
    f = autobatch(cell, core=core)
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, torch.tanh(x) * 2)
    assert "LazyTensor" in capsys.readouterr().out
    assert f.stats.groups_by_rule.get("block")


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fibers", [True, False])
def test_print_of_pending_values_writes_each_line_whole(core, fibers, capsys):
    # hostile find (stop 35): print writes an argument, then converts the next; str() of a
    # pending value waits, so other instances printed in the middle of the line
    def fn(x):
        y = x * 2
        print("val", y.sum(), "end", sep="|")
        return y

    import builtins

    original_print = builtins.print
    xs = [torch.tensor([float(i), 1.0]) for i in range(4)]
    for x in xs:
        fn(x)
    eager = capsys.readouterr().out
    autobatch(fn, core=core, fibers=fibers)(xs)
    assert capsys.readouterr().out == eager
    import builtins

    assert builtins.print is original_print  # the call's patch is gone


@pytest.mark.parametrize("core", CORES)
def test_repr_of_a_pending_value_stays_its_description(core):
    # documented (reliability #140): repr() does not wait (batchcraft's own messages use it), so
    # repr(x) and containers printed with their tensors show the lazy description
    def fn(x):
        y = x * 2
        return y, repr(y), str([y])

    for y, r, lst in autobatch(fn, core=core)([torch.ones(2), torch.zeros(2)]):
        assert r.startswith("LazyTensor(shape=(2,)") and "LazyTensor" in lst


@pytest.mark.parametrize("core", CORES)
def test_a_half_shared_parameter_gradient_rounds_once(core):
    # documented (reliability #141): eager adds each instance's float16 gradient into .grad,
    # rounding each time; batched, one reduction over the instances rounds once
    torch.manual_seed(0)
    p = torch.randn(8).half().requires_grad_()
    xs = [torch.randn(8).half() for _ in range(16)]
    out = autobatch(lambda x: x * p, core=core)(xs)
    (g,) = torch.autograd.grad(sum(o.float().sum() for o in out), p)
    once = torch.stack([x.float() for x in xs]).sum(0).half()
    torch.testing.assert_close(g, once, atol=0, rtol=0)


@pytest.mark.parametrize("core", CORES)
def test_lazy_values_freed_and_made_again_keep_their_identity_rules(core):
    # the C core reuses the memory of freed lazy values (a free list): a weak reference to a
    # dropped one must die, a new one must be a distinct live object, and no reference to the
    # LazyTensor type may be lost or leaked over many calls
    import gc
    import sys
    import weakref

    from batchcraft.autobatching.lazy import LazyTensor

    seen = []

    def fn(x):
        y = torch.tanh(x)
        ref = weakref.ref(y)
        ident = id(y)
        del y
        dead = ref() is None
        zs = [x * k for k in range(1, 6)]  # (one of these may take the freed memory)
        seen.append((dead, all(ref() is None for _ in zs), ident))
        return sum(zs) + torch.tanh(x)

    xs = [torch.randn(3) for _ in range(4)]
    f = autobatch(fn, core=core)
    f(xs)
    gc.collect()
    before = sys.getrefcount(LazyTensor)
    for _ in range(20):
        out = f(xs)
    gc.collect()
    assert sys.getrefcount(LazyTensor) == before
    assert all(dead and still_dead for dead, still_dead, _ in seen)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, sum(x * k for k in range(1, 6)) + torch.tanh(x))


def test_a_subclass_of_the_lazy_type_frees_with_balanced_type_references():
    # LazyTensor's own dealloc is a C function that drops the type reference itself (in place of
    # CPython's subtype_dealloc); reached as a further subclass's base dealloc it must leave that
    # to the subclass's
    import gc
    import sys

    from batchcraft.autobatching.lazy import LazyTensor

    class Sub(LazyTensor):
        __slots__ = ()

    gc.collect()
    sub_refs, lazy_refs = sys.getrefcount(Sub), sys.getrefcount(LazyTensor)
    for _ in range(100):
        Sub(None, 0, 0, 0)
        LazyTensor(None, 0, 0, 0)
    gc.collect()
    assert sys.getrefcount(Sub) == sub_refs and sys.getrefcount(LazyTensor) == lazy_refs


@pytest.mark.parametrize("core", CORES)
def test_calls_after_a_smaller_or_larger_one_record_the_same(core):
    # the C recorder's arrays are reserved at the last call's size (api: reserve/sizes)
    lin = torch.nn.Linear(4, 4)

    def fn(n):
        h = torch.zeros(4)
        for _ in range(n):
            h = torch.tanh(lin(h) + 1)
        return h

    f = autobatch(fn, core=core)
    for ns in ([3, 1], [40, 70, 5], [2], [90] * 8):
        out = f(ns)
        for o, n in zip(out, ns):
            torch.testing.assert_close(o, fn(n))
    if core == "c":
        nodes, inputs = f._sizes
        assert nodes >= 8 * 90 * 2 and inputs > 0


def test_a_long_chain_of_lazy_views_frees_without_exhausting_the_c_stack():
    # each view holds its base; the lazy type's own dealloc (in place of CPython's subtype_dealloc)
    # keeps the interpreter's trashcan, so freeing the head of a long chain does not recurse
    # once per link on the C stack (run in a subprocess: without it, the process crashes)
    import subprocess
    import sys

    code = ("from batchcraft.autobatching.lazy import LazyTensor\n"
            "x = LazyTensor(None, 0, 0, 0)\n"
            "for _ in range(1_000_000):\n"
            "    y = LazyTensor(None, 0, 0, 0); y.base = x; x = y\n"
            "del y; x = None\nprint('freed')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "freed" in out.stdout, out.stderr[-2000:]
