"""Hostile inputs: each gives eager's results or one clear error naming the instance and cause.

Error policy (docs/reliability.md): when instance code raises, or an operation fails for one
instance, the *whole call* fails with :class:`~batchcraft.errors.InstanceError` whose
``.instance`` is that instance's index and whose message names the cause (the original exception
is ``__cause__``). No partial results are returned, and the runtime is left clean (no recording
mode or recorder left active), so the next call works.
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import tracemalloc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchcraft import autobatch, static_block

from batchcraft.autobatching import stack as _rec
from batchcraft.errors import AutobatchError, InstanceError, UnsupportedOperationError

from equivalence import CORES, assert_matches_eager

torch.manual_seed(0)
LIN = nn.Linear(3, 3)
CELL = nn.GRUCell(3, 3)
PARAMS = list(LIN.parameters()) + list(CELL.parameters())


def mlp(x):
    return torch.tanh(LIN(x)) * x


def assert_clean_runtime():
    """No recorder and no recording TorchFunctionMode left behind; eager torch works."""
    assert _rec.current() is None
    assert torch._C._len_torch_function_stack() == 0
    assert type(torch.tanh(torch.ones(2))) is torch.Tensor


def both_schedulers(fn):
    return pytest.mark.parametrize("opts", [dict(), dict(scheduler="agenda"), dict(fibers=False)])(fn)


# ---------------------------------------------------------------------------------------------
# NaN and inf
# ---------------------------------------------------------------------------------------------
@both_schedulers
def test_nan_and_inf_propagate_like_eager(opts):
    nan, inf = float("nan"), float("inf")
    xs = [torch.tensor([nan, 1.0, 2.0]), torch.tensor([inf, -inf, 0.5]), torch.randn(3),
          torch.tensor([0.0, 0.0, 0.0])]

    def fn(x):
        y = CELL(mlp(x), torch.tanh(x))
        return y / x.abs().sum(), torch.log(x.abs()), torch.softmax(x, 0)

    out = autobatch(fn, **opts)(xs)
    for o, x in zip(out, xs):
        for a, b in zip(o, fn(x)):
            torch.testing.assert_close(a, b, equal_nan=True)
    # the NaN of instance 0 does not leak into the other instances' rows
    assert not torch.isnan(out[2][0]).any() and torch.isnan(out[0][0]).all()


def test_nan_gradients_match_eager_and_stay_in_their_instance():
    xs = [torch.tensor([float("nan"), 1.0, 2.0]), torch.randn(3), torch.randn(3)]
    f = autobatch(lambda x: (mlp(x) ** 2).sum())
    gb = torch.autograd.grad(sum(o for o in f(xs[1:])), LIN.weight)[0]
    ge = torch.autograd.grad(sum((mlp(x) ** 2).sum() for x in xs[1:]), LIN.weight)[0]
    torch.testing.assert_close(gb, ge)
    out = f(xs)
    gb = torch.autograd.grad(out[0], LIN.weight, retain_graph=True)[0]  # outputs share one graph
    ge = torch.autograd.grad((mlp(xs[0]) ** 2).sum(), LIN.weight)[0]
    torch.testing.assert_close(gb, ge, equal_nan=True)


def test_bug6_documented_nan_instance_poisons_shared_weight_gradients():
    # autobatch-bugs.md #6, documented (README "Differences from eager"): a NaN input makes the
    # shared weights' gradients NaN for the whole call, even if its loss is left out; gradients
    # of the finite instances' own inputs stay eager's.
    xs = [torch.tensor([float("nan"), 1.0, 2.0]), torch.randn(3), torch.randn(3, requires_grad=True)]
    out = autobatch(lambda x: (mlp(x) ** 2).sum())(xs)
    finite = [o for o in out if torch.isfinite(o)]
    assert len(finite) == 2
    gw, gx = torch.autograd.grad(sum(finite), [LIN.weight, xs[2]])
    assert torch.isnan(gw).all()  # eager over xs[1:] would be finite
    torch.testing.assert_close(gx, torch.autograd.grad((mlp(xs[2]) ** 2).sum(), xs[2])[0])


def test_bug5_documented_outputs_share_one_graph():
    # autobatch-bugs.md #5, documented (README "Differences from eager"): per-instance backward
    # needs retain_graph=True; the gradients are then eager's.
    xs = [torch.randn(3), torch.randn(3)]
    out = autobatch(lambda x: (mlp(x) ** 2).sum())(xs)
    for o, x in zip(out, xs):
        g = torch.autograd.grad(o, LIN.weight, retain_graph=True)[0]
        torch.testing.assert_close(g, torch.autograd.grad((mlp(x) ** 2).sum(), LIN.weight)[0])
    out = autobatch(lambda x: (mlp(x) ** 2).sum())(xs)
    torch.autograd.grad(out[0], LIN.weight)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out[1], LIN.weight)


# ---------------------------------------------------------------------------------------------
# shapes, dtypes, devices
# ---------------------------------------------------------------------------------------------
def test_mismatched_shape_in_one_signature_names_the_instance():
    xs = [torch.randn(3), torch.randn(3), torch.randn(4), torch.randn(3)]
    with pytest.raises(InstanceError, match=r"instance 2: .*shapes cannot be multiplied") as ei:
        autobatch(mlp)(xs)
    assert ei.value.instance == 2 and isinstance(ei.value.__cause__, RuntimeError)
    assert_clean_runtime()


def test_mismatched_shape_after_a_sync_names_the_instance():
    def fn(x):
        h = LIN(x[:3])
        if h.sum() > -1e9:  # every instance yields here first
            return LIN(x)
        return h

    with pytest.raises(InstanceError, match="instance 1") as ei:
        autobatch(fn)([torch.randn(3), torch.randn(5)])
    assert ei.value.instance == 1
    assert_clean_runtime()


def test_dtype_mix_in_elementwise_work_matches_eager():
    xs = [torch.randn(3), torch.randn(3, dtype=torch.float64), torch.arange(3), torch.tensor([True, False, True])]
    fn = lambda x: (x * 2 + 1, x.sum(), -x if x.dtype != torch.bool else ~x)  # noqa: E731
    out = autobatch(fn)(xs)
    for o, x in zip(out, xs):
        for a, b in zip(o, fn(x)):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b)


def test_dtype_mix_with_float32_parameters_names_the_instance():
    xs = [torch.randn(3), torch.randn(3), torch.randn(3, dtype=torch.float64)]
    with pytest.raises(InstanceError, match=r"instance 2: .*(dtype|Double)") as ei:
        autobatch(mlp)(xs)
    assert ei.value.instance == 2


def test_meta_and_cpu_instances_mixed_match_eager():
    xs = [torch.randn(3, device="meta"), torch.randn(3), torch.randn(3, device="meta")]
    out = autobatch(lambda x: x * 2 + 1)(xs)
    assert [o.device.type for o in out] == ["meta", "cpu", "meta"]
    torch.testing.assert_close(out[1], xs[1] * 2 + 1)


@pytest.mark.gpu
def test_cpu_and_cuda_instances_mixed():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    xs = [torch.randn(3), torch.randn(3, device="cuda"), torch.randn(3)]
    out = autobatch(lambda x: torch.tanh(x * 2))(xs)
    assert [o.device.type for o in out] == ["cpu", "cuda", "cpu"]
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, torch.tanh(x * 2))
    lin = nn.Linear(3, 3)  # CPU weights, CUDA instance: eager fails, so must autobatch
    with pytest.raises(InstanceError) as ei:
        autobatch(lin)(xs)
    assert ei.value.instance == 1


# ---------------------------------------------------------------------------------------------
# instances that raise or return odd things
# ---------------------------------------------------------------------------------------------
@both_schedulers
def test_instance_that_raises_fails_the_whole_call_cleanly(opts):
    def fn(x):
        h = mlp(x)
        if h.sum() > -1e9 and x[0] > 100:  # decided after a sync
            raise ValueError(f"bad value {float(x[0])}")
        return h

    xs = [torch.randn(3), torch.tensor([101.0, 0.0, 0.0]), torch.randn(3)]
    with pytest.raises(InstanceError, match=r"instance 1: ValueError: bad value 101") as ei:
        autobatch(fn, **opts)(xs)
    assert ei.value.instance == 1 and isinstance(ei.value.__cause__, ValueError)
    assert ei.value.code == "instance-error"
    assert_clean_runtime()
    # the next call works
    out = autobatch(fn, **opts)([xs[0], xs[2]])
    torch.testing.assert_close(out[1], mlp(xs[2]))


def test_base_exceptions_propagate_and_leave_runtime_clean():
    def fn(x):
        if (x * 2).sum() > -1e9:
            raise KeyboardInterrupt
        return x

    with pytest.raises(KeyboardInterrupt):
        autobatch(fn)([torch.randn(3), torch.randn(3)])
    assert_clean_runtime()


def test_batchcraft_error_in_instance_keeps_its_type_and_names_the_instance():
    shared = torch.zeros(2)

    def fn(x):
        y = x * 2
        if x.shape[0] == 2:
            shared.add_(y)  # per-instance values written into a captured tensor: refused
        return y

    with pytest.raises(UnsupportedOperationError, match="shared tensor") as ei:
        autobatch(fn)([torch.randn(3), torch.randn(3), torch.randn(2)])
    assert ei.value.instance == 2 and "instance 2" in str(ei.value)
    assert torch.equal(shared, torch.zeros(2))  # nothing was written


def test_non_tensor_outputs_come_back_unchanged():
    sentinel = object()
    fn = lambda x: (None, "text", 7, sentinel, [x * 2, {"k": 1.5}])  # noqa: E731
    out = autobatch(fn)([torch.ones(2), torch.zeros(2)])
    assert out[0][:4] == (None, "text", 7, sentinel) and out[1][4][1] == {"k": 1.5}
    torch.testing.assert_close(out[0][4][0], torch.full((2,), 2.0))
    assert autobatch(lambda x: None)([torch.ones(1)] * 3) == [None, None, None]


def test_lazy_value_that_escapes_the_call_raises_clearly():
    """Also after the call dropped its runtime (no reference cycle): a computed value still reads."""
    escaped = []

    def fn(x):
        y = x * 2
        escaped.append(y)
        return y.sum()

    xs = [torch.randn(3) for _ in range(2)]
    autobatch(fn)(xs)
    torch.testing.assert_close(torch.tensor(escaped[1].tolist()), xs[1] * 2)  # computed: readable
    with pytest.raises(AutobatchError, match="outside batchcraft.autobatch"):
        escaped[0] + 1
    with pytest.raises(AutobatchError, match="outside batchcraft.autobatch"):
        torch.tanh(escaped[0])


class _Box:
    def __init__(self, t):
        self.t = t


def test_bug4_lazy_value_inside_unknown_output_object():
    try:
        out = autobatch(lambda x: _Box(x * 2))([torch.ones(3)])
    except AutobatchError as exc:  # a clear error naming the instance is acceptable
        assert "instance 0" in str(exc)
        return
    assert type(out[0].t) is torch.Tensor  # or the value resolved


# ---------------------------------------------------------------------------------------------
# deep recursion, fan-out, empty batches
# ---------------------------------------------------------------------------------------------
def _chain(n):
    t = ()
    for _ in range(n):
        t = (t,)
    return t


def _rec_fn(tree):
    h = torch.ones(3)
    for c in tree:
        h = h + _rec_fn(c)
    return torch.tanh(LIN(h))


def test_recursion_deeper_than_python_limit_names_the_instance():
    deep = _chain(sys.getrecursionlimit() + 100)
    with pytest.raises(InstanceError, match="instance 1: RecursionError") as ei:
        autobatch(_rec_fn)([_chain(3), deep, _chain(2)])
    assert ei.value.instance == 1
    assert_clean_runtime()


@pytest.mark.slow
@pytest.mark.parametrize("fibers", [True, False])
def test_recursion_of_thousands_of_nodes_with_raised_limit(fibers):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        trees = [_chain(3000), _chain(1500), _chain(1)]
        out = autobatch(_rec_fn, fibers=fibers)(trees)
        ref = [_rec_fn(t) for t in trees]
    finally:
        sys.setrecursionlimit(old)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scheduler", ["depth", "agenda"])
def test_graph_deeper_than_python_limit_forward_and_backward(scheduler):
    # iterative instance code, a chain of 5,000 dependent operations per instance
    def fn(x):
        for _ in range(x.shape[0] * 1000):
            x = torch.tanh(LIN(x[:3]))
        return x

    xs = [torch.randn(5), torch.randn(3), torch.randn(4)]
    f = assert_matches_eager(fn, xs, list(LIN.parameters()), scheduler=scheduler)
    assert f.stats.batched_calls <= 3 * 5000 + 10  # slice, linear, tanh per step: batched across instances


def test_huge_fan_out_matches_eager():
    emb = nn.Embedding(50, 3)

    def fn(ids):
        kids = [torch.tanh(LIN(emb(torch.tensor(i)))) for i in ids]
        return torch.stack(kids).sum(0), sum(kids[1:], kids[0]), torch.cat(kids).max()

    insts = [[i % 50 for i in range(3000)], [7], list(range(50)) * 20]
    f = assert_matches_eager(fn, insts, list(LIN.parameters()) + list(emb.parameters()), atol=1e-3)
    assert f.stats.fallbacks == 0
    assert f.stats.batched_calls < 4 * 10 + 3050  # lookups/linears/tanh batch across instances


@pytest.mark.parametrize("empty", [[], (), iter([]), range(0)])
def test_empty_batches(empty):
    f = autobatch(mlp)
    assert f(empty) == []
    assert f.stats.instances == 0 and f.stats.ops_recorded == 0


def test_empty_tensors_inside_instances_match_eager():
    xs = [torch.randn(0, 3), torch.randn(2, 3), torch.randn(0, 3)]
    fn = lambda x: (x.sum(0), LIN(x), torch.cat([x, x]).shape[0])  # noqa: E731
    assert_matches_eager(fn, xs, list(LIN.parameters()))


# ---------------------------------------------------------------------------------------------
# memory layout and autograd modes
# ---------------------------------------------------------------------------------------------
def test_non_contiguous_and_expanded_instances_match_eager():
    strided_leaf = torch.randn(4, 6)[:, ::2].requires_grad_()  # a leaf that is not contiguous
    expanded_leaf = torch.randn(3).expand(4, 3).requires_grad_()  # stride 0, a leaf too
    xs = [torch.randn(3, 4).t(), torch.randn(3, 8).t()[::2], torch.randn(3).expand(4, 3), strided_leaf,
          expanded_leaf, torch.randn(4, 3)[:, [2, 0, 1]], torch.randn(4, 3)]
    assert not xs[1].is_contiguous() and xs[2].stride(0) == 0 and not strided_leaf.is_contiguous()
    fn = lambda x: torch.tanh(LIN(x)).sum(0) + x.mean(0)  # noqa: E731
    assert_matches_eager(fn, xs, list(LIN.parameters()) + [strided_leaf, expanded_leaf])


def test_requires_grad_mix_gives_eager_gradients():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    c = torch.randn(3, requires_grad=True)
    fn = lambda x: (mlp(x) * x).sum()  # noqa: E731
    out = autobatch(fn)([a, b, c])
    ga, gc, gw = torch.autograd.grad(out[0] + 2 * out[2], [a, c, LIN.weight])
    ea, ec, ew = torch.autograd.grad(fn(a) + 2 * fn(c), [a, c, LIN.weight])
    torch.testing.assert_close((ga, gc, gw), (ea, ec, ew))


def test_bug2_requires_grad_does_not_leak_between_instances():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    out = autobatch(lambda x: (x * x).sum())([a, b])
    assert [o.requires_grad for o in out] == [True, False]


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_outside(ctx):
    xs = [torch.randn(3) for _ in range(4)]
    with ctx():
        out = autobatch(mlp)(xs)
        ref = [mlp(x) for x in xs]
    for o, r in zip(out, ref):
        assert not o.requires_grad
        assert o.is_inference() == r.is_inference()
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_inside(ctx):
    def fn(x):
        with ctx():
            frozen = LIN(x)
        return torch.tanh(LIN(x)) + frozen  # add saves nothing: legal with inference tensors

    assert_matches_eager(fn, [torch.randn(3) for _ in range(5)], list(LIN.parameters()))


def test_inference_tensor_saved_for_backward_fails_as_in_eager():
    # work recorded inside torch.inference_mode() runs under inference mode, so its results are
    # inference tensors and saving one for backward fails, as in eager
    def fn(x, ctx):
        with ctx():
            frozen = LIN(x)
        return torch.tanh(LIN(x)) * frozen

    xs = [torch.randn(3) for _ in range(3)]
    with pytest.raises(RuntimeError, match="Inference tensors"):
        fn(xs[0], torch.inference_mode)
    with pytest.raises(InstanceError, match="Inference tensors"):
        autobatch(lambda x: fn(x, torch.inference_mode))(xs)
    assert_clean_runtime()
    out = autobatch(lambda x: fn(x, torch.no_grad))(xs)  # the supported spelling
    torch.testing.assert_close(out, [fn(x, torch.no_grad) for x in xs])


def test_grad_mode_toggled_between_statements_matches_eager():
    def fn(x):
        torch.set_grad_enabled(False)
        try:
            a = LIN(x)
        finally:
            torch.set_grad_enabled(True)
        return LIN(x) + a

    assert_matches_eager(fn, [torch.randn(3) for _ in range(3)], list(LIN.parameters()))


@pytest.mark.parametrize("how", ["branch", "item", "int"])
def test_static_block_that_needs_a_value_runs_unblocked_and_says_why(how):
    # before stop 47 this raised AutobatchError ("must not branch on tensor values"): an
    # unsupported construct must fall back, counted, with its reason
    body = {"branch": lambda x: x * 2 if x.sum() > 0 else x,
            "item": lambda x: x * x.sum().item(),
            "int": lambda x: x[: int(x.abs().argmax()) + 1].sum() + x}[how]
    bad_block = static_block(lambda x: body(x))
    xs = [torch.randn(3) for _ in range(4)]
    f = autobatch(lambda x: bad_block(x + 1))
    for o, x in zip(f(xs), xs):
        torch.testing.assert_close(o, body(x + 1))
    (reason,) = f.stats.fallback_reasons
    assert "runs unblocked" in reason and "needs a tensor's value" in reason
    assert_clean_runtime()


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------
def test_two_threads_calling_auto_batched_functions_at_once():
    lin2 = nn.Linear(3, 3)

    def branchy(x):
        h = x
        for _ in range(int(x.shape[0]) % 4 + 1):
            h = torch.tanh(LIN(h))
            if h.sum() > 0:
                h = h * 0.5
        return h

    def plain(x):
        return torch.sigmoid(lin2(x)).sum(-1)

    xs = [torch.randn(k % 3 + 1, 3) for k in range(24)]
    refs = {branchy: [branchy(x) for x in xs], plain: [plain(x) for x in xs]}
    shared = autobatch(branchy)  # one AutoBatched object used by two threads too
    jobs = [(autobatch(branchy), branchy), (autobatch(plain), plain), (shared, branchy), (shared, branchy)]
    errors: list = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads as often as possible

    def work(f, fn):
        try:
            for _ in range(8):
                for o, r in zip(f(xs), refs[fn]):
                    torch.testing.assert_close(o, r)
        except BaseException as exc:  # noqa: BLE001 - report everything from the thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert_clean_runtime()


# ---------------------------------------------------------------------------------------------
# resources
# ---------------------------------------------------------------------------------------------
def _chain_fn(x):
    for _ in range(20):
        x = torch.tanh(x * 1.5 + 0.1)
    return x


def _recorded_peak_bytes(n_instances: int) -> tuple[int, int]:
    """Peak Python-heap bytes while recording ``n_instances`` (no flush until the end), ops."""
    xs = [torch.randn(4) for _ in range(n_instances)]
    f = autobatch(_chain_fn, fibers=False)
    with torch.no_grad():
        f(xs[:2])  # warm the signature caches
        gc.collect()
        tracemalloc.start()
        try:
            f(xs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return peak, f.stats.ops_recorded


def test_recorded_graph_memory_grows_linearly_with_work():
    sizes = (50, 100, 200, 400)
    peaks = [_recorded_peak_bytes(n) for n in sizes]
    per_op = [p / ops for p, ops in peaks]
    # marginal bytes per recorded operation stay about constant (linear, not quadratic)
    marginal = [(peaks[i + 1][0] - peaks[i][0]) / (peaks[i + 1][1] - peaks[i][1]) for i in range(3)]
    print("bytes per op", per_op, "marginal", marginal)
    assert max(marginal) / min(marginal) < 1.6, (per_op, marginal)
    assert 100 < marginal[-1] < 5000, marginal  # a node costs hundreds of bytes, not kilobytes


def test_max_pending_bounds_pending_nodes_across_instances():
    xs = [torch.randn(4) for _ in range(300)]
    f = autobatch(_chain_fn, max_pending=100)
    out = f(xs)
    assert f.stats.peak_pending <= 100 + 20 * 2  # at most one more step of each fiber past the limit
    torch.testing.assert_close(out[7], _chain_fn(xs[7]))
    g = autobatch(_chain_fn)
    g(xs)
    assert g.stats.peak_pending >= 300 * 20 - 1  # without the option everything waits


def test_bug3_max_pending_bounds_a_single_long_instance():
    def long_instance(x):
        for _ in range(2000):
            x = x * 1.0001
        return x

    f = autobatch(long_instance, max_pending=100)
    out = f([torch.randn(3), torch.randn(3)])
    assert out[0].shape == (3,)
    assert f.stats.peak_pending <= 200


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


@pytest.mark.slow
def test_many_batches_show_no_memory_growth():
    emb = nn.Embedding(100, 8)
    cell = static_block(nn.Linear(16, 8))

    def fn(ids):
        h = torch.zeros(8)
        for i in ids:
            h = torch.tanh(cell(torch.cat([emb(torch.tensor(i)), h])))
            if h.sum() > 2:  # a value request per step: fibers too
                h = h * 0.5
        return h

    f = autobatch(fn)
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, 100, (int(n),), generator=g).tolist()
                for n in torch.randint(1, 5, (25,), generator=g)] for _ in range(10)]
    warmup, measured = 10, 80  # 2,250 instances in batches of 25

    def run(k):
        for j in range(k):
            out = f(batches[j % len(batches)])
            sum(o.sum() for o in out).backward()

    run(warmup)
    gc.collect()
    blocks0, rss0 = sys.getallocatedblocks(), _rss_bytes()
    run(measured // 2)
    gc.collect()
    blocks1, rss1 = sys.getallocatedblocks(), _rss_bytes()
    run(measured // 2)
    gc.collect()
    blocks2, rss2 = sys.getallocatedblocks(), _rss_bytes()
    # a leak of one object per batch would show as >= 100 blocks per half; allow noise
    print("allocated blocks", blocks0, blocks1, blocks2, "rss MiB", rss0 / 2 ** 20, rss1 / 2 ** 20, rss2 / 2 ** 20)
    assert blocks2 - blocks1 < 800 and blocks1 - blocks0 < 3000, (blocks0, blocks1, blocks2)
    assert rss2 - rss1 < 32 * 2 ** 20, f"RSS grew {(rss2 - rss1) / 2 ** 20:.1f} MiB over {measured // 2} batches"


# ---------------------------------------------------------------------------------------------
# regression tests of bugs found by the fuzzer
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fibers", [True, False])
def test_bug1_boolean_mask_index_on_computed_mask(fibers):
    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, 5.0, 0.5])]
    for fn in (lambda x: x[x > 0].sum(), lambda x: x.masked_select(x > 0).sum(),
               lambda x: (x > 0).nonzero().sum(), lambda x: x[(x * 0).long().sum() + 1]):
        out = autobatch(fn, fibers=fibers)(xs)
        for o, x in zip(out, xs):
            torch.testing.assert_close(o, fn(x))


def test_bug9_negative_zero_constant_is_its_own_signature():
    fn = lambda inst: 1 / (inst[0] * inst[1])  # noqa: E731
    xs = [(torch.ones(2), 0.0), (torch.ones(2), -0.0)]
    out = autobatch(fn)(xs)
    torch.testing.assert_close(out, [fn(x) for x in xs])


def _shared_across_phases(scheduler):
    import batchcraft

    memo: dict = {}

    def fn(n_phases):
        for _ in range(n_phases):
            batchcraft.phase()
        if "v" not in memo:  # a cache shared by all instances
            memo["v"] = torch.tanh(LIN(torch.ones(3)))
        return memo["v"] + n_phases

    try:
        out = autobatch(fn, scheduler=scheduler)([1, 0, 2])
    except AutobatchError as exc:  # a clear error naming the instance is acceptable too
        assert exc.instance is not None
        return
    memo.clear()
    torch.testing.assert_close(out, [fn(k) for k in (1, 0, 2)])


def test_value_shared_across_instances_and_phases_agenda():
    _shared_across_phases("agenda")


def test_bug10_value_shared_across_instances_and_phases():
    _shared_across_phases("depth")


def test_bug11_overflowing_scalar_leaf_names_the_instance():
    with pytest.raises(InstanceError) as ei:
        autobatch(lambda x: x + torch.tensor(2 ** 70 if x.shape[0] == 2 else 1))([torch.ones(1), torch.ones(2)])
    assert ei.value.instance == 1


def test_bug12_nan_constant_batches():
    f = autobatch(lambda x: x * float("nan"))
    out = f([torch.ones(1)] * 20)
    assert all(torch.isnan(o).all() for o in out)
    assert f.stats.batched_calls == 1


def test_bug13_nested_autobatch_over_lazy_values():
    inner = autobatch(lambda v: torch.tanh(LIN(v)))
    fn = lambda x: sum(inner([x, x * 2]))  # noqa: E731
    xs = [torch.randn(3) for _ in range(3)]
    try:
        out = autobatch(fn)(xs)
    except UnsupportedOperationError as exc:  # a clear refusal naming the instance is fine
        assert exc.instance == 0 and "autobatch" in str(exc)
        return
    ref = [torch.tanh(LIN(x)) + torch.tanh(LIN(x * 2)) for x in xs]
    torch.testing.assert_close(out, ref)


def test_nested_autobatch_over_concrete_values():
    inner = autobatch(lambda v: torch.tanh(LIN(v)))

    def fn(x):
        ys = inner([torch.ones(3), torch.zeros(3)])
        return x + ys[0] - ys[1]

    xs = [torch.randn(3) for _ in range(3)]
    ref = [x + torch.tanh(LIN(torch.ones(3))) - torch.tanh(LIN(torch.zeros(3))) for x in xs]
    torch.testing.assert_close(autobatch(fn)(xs), ref)
    assert_clean_runtime()


def test_bug14_requires_grad_on_a_detached_value_makes_a_leaf_as_in_eager():
    def fn(x):
        y = (x * 2).detach().requires_grad_()
        return y, y.requires_grad, y.is_leaf

    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    out = autobatch(fn)(xs)
    for (y, rg, leaf), x in zip(out, xs):
        assert rg is True and leaf is True
        torch.testing.assert_close(y, x.detach() * 2)
        assert y.requires_grad


def test_bug15_backward_inside_instance_code():
    def fn(x):
        (LIN(x) ** 2).sum().backward()
        return x

    xs = [torch.randn(3) for _ in range(3)]
    LIN.zero_grad()
    try:
        autobatch(fn)(xs)
    except UnsupportedOperationError as exc:  # a clear refusal for the first instance is fine
        assert exc.instance == 0
        return
    got = LIN.weight.grad.clone()
    LIN.zero_grad()
    for x in xs:
        fn(x)
    torch.testing.assert_close(got, LIN.weight.grad)
    LIN.zero_grad()


def test_bug16_max_steps_stops_an_instance_that_never_syncs():
    import signal

    def on_alarm(signum, frame):
        raise TimeoutError("no StepLimitError after 3 s: the instance was never stopped")

    def fn(x):
        while True:
            x = x + 1

    from batchcraft.errors import StepLimitError

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(3)
    try:
        with pytest.raises(StepLimitError):
            autobatch(fn, max_steps=1000)([torch.ones(1)])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_max_steps_stops_an_instance_that_loops_on_a_value():
    from batchcraft.errors import StepLimitError

    def fn(x):
        while x.sum() > -1:  # never false for instance 0
            x = x + 1
        return x

    with pytest.raises(StepLimitError, match="^instance 0: exceeded max_steps=50"):
        autobatch(fn, max_steps=50)([torch.ones(1), -torch.ones(1) * 5])
    assert_clean_runtime()


def test_bug17_step_limit_error_names_instance_attribute():
    from batchcraft.errors import StepLimitError

    def fn(x):
        while x.sum() > -1:
            x = x + 1
        return x

    with pytest.raises(StepLimitError) as ei:
        autobatch(fn, max_steps=50)([torch.ones(1), -torch.ones(1) * 5])
    assert ei.value.instance == 0


def test_common_modules_on_lazy_values_match_eager():
    lstm = nn.LSTM(3, 4, batch_first=True)
    mha = nn.MultiheadAttention(3, 1, batch_first=True)
    conv = nn.Conv1d(3, 4, 3, padding=1)
    bn = nn.BatchNorm1d(3).eval()

    def fn(x):  # x: (L, 3), L differs per instance
        out, (h, c) = lstm(x.unsqueeze(0))
        a, _ = mha(x.unsqueeze(0), x.unsqueeze(0), x.unsqueeze(0))
        return out.sum(1).squeeze(0) + h.sum() + a.mean() + conv(x.t()).mean(-1) + bn(x).sum()

    params = [p for m in (lstm, mha, conv) for p in m.parameters()]
    assert_matches_eager(fn, [torch.randn(n, 3) for n in (2, 5, 3, 5)], params)


def test_random_draws_differ_per_instance_and_repeat_with_the_seed():
    # FIELD-FAULTS: DyNet PR #812/#1053 (one dropout mask shared by the whole batch)
    fn = lambda x: F.dropout(x, 0.5, training=True) + torch.randn(50) * 0  # noqa: E731
    torch.manual_seed(0)
    a = autobatch(fn)([torch.ones(50)] * 4)
    torch.manual_seed(0)
    b = autobatch(fn)([torch.ones(50)] * 4)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert len({tuple(p.tolist()) for p in a}) == 4


def test_static_block_module_deepcopy_uses_its_own_weights():
    import copy

    m = static_block(nn.Linear(3, 3))
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        m2.weight.zero_()
        m2.bias.fill_(1.0)
    x = torch.randn(3)
    torch.testing.assert_close(autobatch(lambda v: m2(v))([x])[0], torch.ones(3))
    torch.testing.assert_close(autobatch(lambda v: m(v))([x])[0], m(x))


def test_bug18_static_block_module_instance_pickles():
    import io

    m = static_block(nn.Linear(3, 3))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m3 = torch.load(buf, weights_only=False)
    x = torch.randn(3)
    torch.testing.assert_close(autobatch(lambda v: m3(v))([x])[0], m(x))


def test_bug19_requires_grad_does_not_leak_through_value_dependent_ops():
    def fn(inst):
        x, k = inst
        h = torch.tanh(x)
        return h + h[k % 1], h[h > 0].sum()  # a tensor index and a boolean mask: run on values

    xs = [(torch.ones(1, requires_grad=True), torch.tensor(0)), (torch.ones(1), torch.tensor(0))]
    out = autobatch(fn)(xs)
    assert [[t.requires_grad for t in o] for o in out] == [[True, True], [False, False]]


def test_bug20_documented_outputs_are_views_clone_what_you_keep():
    # autobatch-bugs.md #20, documented (autobatch docstring, README "Differences from eager"):
    # outputs are row views of batched results, like torch.unbind; .clone() keeps only its own.
    lin = nn.Linear(8, 32)
    f = autobatch(lambda x: torch.tanh(lin(x)))
    with torch.no_grad():
        out = f([torch.randn(8) for _ in range(200)])
    kept, own = out[0].detach(), out[0].clone()
    del out
    assert kept.untyped_storage().nbytes() >= 4 * 32 * 200  # the view holds the whole batch
    assert own.untyped_storage().nbytes() == 4 * 32  # eager-sized
    torch.testing.assert_close(kept, own)


@pytest.mark.parametrize("core", CORES)
def test_data_ptr_tells_values_apart_and_views_share_their_bases(core):
    # reliability #276: data_ptr() of every lazy value was the placeholder's 0, so two distinct
    # tensors compared equal by it and dicts keyed by it collapsed

    def fn(x):
        a, b = x * 2, x + 1
        c, d = a.view(-1), a[1:]
        keys = {a.data_ptr(): "a", b.data_ptr(): "b", c.data_ptr(): "c"}
        return torch.tensor([a.data_ptr() != b.data_ptr(), a.data_ptr() == c.data_ptr(),
                             d.data_ptr() - a.data_ptr() == a.element_size(), len(keys) == 2, a.data_ptr() != 0,
                             x.view(-1).data_ptr() == x.data_ptr(), x[1:][1:].data_ptr() - x.data_ptr() == 8])

    xs = [torch.ones(3), torch.ones(3) * 3]
    assert [fn(x).tolist() for x in xs] == [[True] * 7] * 2
    assert [o.tolist() for o in autobatch(fn, core=core)(xs)] == [[True] * 7] * 2


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("ids", [[2, 3, 1], [2, -1, 1]])
def test_an_id_outside_a_per_instance_table_raises_eagers_error(core, ids):
    # a hostile find (stop 49): with a per-instance table, vmap's embedding read the row of
    # another instance's table for an id past this one's (silently)
    table = torch.arange(12.0).reshape(3, 4)

    def fn(i):
        return F.embedding(i, table * 1)

    with pytest.raises(IndexError):
        fn(torch.tensor(ids[1]))
    with pytest.raises(InstanceError, match="index out of range") as info:
        autobatch(fn, core=core)([torch.tensor(v) for v in ids])
    assert info.value.instance == 1
    out = autobatch(fn, core=core)([torch.tensor(v) for v in (0, 2, 1)])
    assert [o.tolist() for o in out] == [fn(torch.tensor(v)).tolist() for v in (0, 2, 1)]


@pytest.mark.parametrize("core", CORES)
def test_documented_a_value_written_in_place_gets_a_new_data_ptr(core):
    # reliability #284, documented (LazyTensor.data_ptr): values are functional, so an in-place
    # update gives the value a new address, where eager's stays
    def fn(x):
        y = x * 2
        before = y.data_ptr()
        y.add_(1)
        return torch.tensor(before == y.data_ptr())

    assert fn(torch.ones(2)).item() is True
    assert autobatch(fn, core=core)([torch.ones(2)])[0].item() is False
