"""Fused elementwise kernels (fuse.py, _fused.c): the maths, the planning, the run-time checks.

Every fused result is compared with eager PyTorch (and the unfused batched program); the counts
in ``RunStats`` show that the kernels really ran. Needs the optional ``_fused`` extension.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchcraft import autobatch, static_block
from batchcraft.autobatching import _native, fuse

# (not from equivalence: test_the_portable_loops_run_* imports this module in a subprocess without tests/)
CORES = ["c", "python"] if _native.available else ["python"]

_fused = pytest.importorskip("batchcraft.autobatching._fused")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    ia = a.numpy().view(np.int32).astype(np.int64)
    ib = b.numpy().view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, -1e-30, 1e-42, 0.625, -0.625, 0.6249, 9.0, -9.0,
           44.0, 88.7, 88.72, 88.73, 89.5, -87.3, -87.4, -103.9, -104.0, -110.0, 20.0, -20.0]


@pytest.mark.parametrize("generic", [False, True], ids=["dispatched", "portable"])
@pytest.mark.parametrize("name,code,fn,max_ulps", [
    ("sigmoid", fuse.SIGMOID, torch.sigmoid, 4), ("tanh", fuse.TANH, torch.tanh, 2),
    ("exp", fuse.EXP, torch.exp, 2), ("relu", fuse.RELU, torch.relu, 0), ("neg", fuse.NEG, torch.neg, 0)])
def test_unary_maths_is_torch_within_a_few_ulps(name, code, fn, max_ulps, generic):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 4, torch.linspace(-105, 105, 4001), torch.tensor(SPECIAL)])
    y = torch.tensor(_fused.map(code, x.tolist(), 0.0, generic), dtype=torch.float32)
    r = fn(x)
    assert torch.equal(torch.isnan(y), torch.isnan(r)), f"{name}: NaN where torch has none (or not)"
    inf = torch.isinf(r)
    assert torch.equal(torch.isinf(y), inf) and torch.equal(y[inf], r[inf]), f"{name}: infinities differ"
    fin = ~torch.isnan(r) & ~inf
    assert _ulps(y[fin], r[fin]).max() <= max_ulps
    zeros = r == 0
    assert torch.equal(torch.signbit(y[zeros]), torch.signbit(r[zeros])), f"{name}: the sign of a zero differs"


@pytest.mark.parametrize("code,s,fn", [(fuse.ADD_S, 0.1, lambda x: x + 0.1), (fuse.MUL_S, -3.0, lambda x: x * -3.0),
                                       (fuse.SUB_S, 2.5, lambda x: x - 2.5), (fuse.RSUB_S, 1.0, lambda x: 1.0 - x)])
def test_scalar_ops_are_torchs_bits(code, s, fn):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    y = torch.tensor(_fused.map(code, x.tolist(), s), dtype=torch.float32)
    assert torch.equal(y, fn(x))


@static_block
class Gates(torch.nn.Module):
    """An LSTM-style tail: a projection, four gates by chunk, products and sums."""

    def __init__(self, d=8):
        super().__init__()
        self.lin = torch.nn.Linear(d, 4 * d)
        self.scale = torch.nn.Parameter(torch.randn(d))

    def forward(self, x, c):
        i, f, g, o = self.lin(x).chunk(4, -1)
        c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = o.sigmoid() * torch.tanh(c2)
        return h * self.scale - 0.5 * torch.relu(-h), c2


def _gates_fn(block):
    def fn(inst):
        x, c = inst
        h, c2 = block(x, c)
        h, c2 = block(h, c2)  # a second level reads the first one's outputs
        return h, c2
    return fn


def _instances(n, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(d, generator=g), torch.randn(d, generator=g)) for _ in range(n)]


def _close(out, ref, atol=2e-6):
    for o, r in zip(out, ref):
        for a, b in zip(o, r):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


def _second_call(fn, xs, **options):
    """``(f, f's second call, eager)`` under ``no_grad``: a program's first run is its checked,
    unfused form; the runs after it are fused."""
    f = autobatch(fn, **options)
    with torch.no_grad():
        f(xs)
        out = f(xs)
        ref = [fn(x) for x in xs]
    return f, out, ref


@pytest.mark.parametrize("core", ["c", "python"])
def test_block_tail_runs_fused_and_matches_eager(core):
    from batchcraft.autobatching import _native

    if core == "c" and not _native.available:
        pytest.skip("C core not built")
    torch.manual_seed(0)
    blk = Gates()
    fn = _gates_fn(blk)
    xs = _instances(12)
    f = autobatch(fn, core=core)
    with torch.no_grad():
        f(xs)  # the first run of a program checks each step; the next ones are fused
        out = f(xs)
        ref = [fn(x) for x in xs]
        unfused = autobatch(fn, core=core, fuse_elementwise=False)(xs)
    _close(out, ref)
    _close(out, unfused)
    s = f.stats
    assert s.fused_kernels == 2 and s.steps_fused == 2 * 15 and s.fallbacks == 0, s.summary()
    assert "fused kernels" in s.summary()


def test_the_lowered_source_keeps_the_steps_for_a_declined_call():
    torch.manual_seed(0)
    blk = Gates()
    f = autobatch(_gates_fn(blk))
    with torch.no_grad():
        f(_instances(4))
        f(_instances(4))  # the second run lowers without the first run's checks: fused
    src = "\n".join(r.source for r in _runners() if r.clusters)
    assert "_fz" in src and "if _r is None:" in src and "else:" in src


def _runners():
    import gc

    from batchcraft.autobatching.lower import Runner

    return [o for o in gc.get_objects() if type(o) is Runner]


def test_training_declines_and_gradients_are_eagers():
    torch.manual_seed(0)
    blk = Gates()
    fn = _gates_fn(blk)
    xs = _instances(6)
    f = autobatch(fn)
    f(xs)  # first call: checked program
    out = f(xs)
    ref = [fn(x) for x in xs]
    _close(out, ref, atol=1e-5)
    assert f.stats.fused_kernels == 0 and f.stats.fused_declined >= 1
    gb = torch.autograd.grad(sum(h.sum() + c.sum() for h, c in out), list(blk.parameters()))
    ge = torch.autograd.grad(sum(h.sum() + c.sum() for h, c in ref), list(blk.parameters()))
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_inputs_that_need_grad_under_no_grad_are_fine():
    # no_grad around the call: a requires_grad input is only read; no autograd history to keep
    torch.manual_seed(0)
    blk = Gates()
    fn = _gates_fn(blk)
    xs = [(x.requires_grad_(), c) for x, c in _instances(5)]
    f, out, ref = _second_call(fn, xs)
    _close(out, ref)
    assert f.stats.fused_kernels >= 1 and not any(t.requires_grad for o in out for t in o)


def test_float64_is_not_fused_and_is_exact():
    torch.manual_seed(0)
    blk = Gates().double()
    fn = _gates_fn(blk)
    xs = [(x.double(), c.double()) for x, c in _instances(5)]
    f, out, ref = _second_call(fn, xs)
    _close(out, ref, atol=1e-12)
    assert f.stats.steps_fused == 0 and f.stats.fused_declined == 0  # never planned


def test_autocast_declines():
    torch.manual_seed(0)
    blk = Gates()
    fn = _gates_fn(blk)
    xs = _instances(5)
    f = autobatch(fn)
    with torch.no_grad():
        f(xs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = f(xs)
            ref = [fn(x) for x in xs]
    for o, r in zip(out, ref):
        for a, b in zip(o, r):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert f.stats.fused_kernels == 0


@static_block
def inplace_between(x):
    t = x * 2.0
    u = t.sigmoid()
    t.add_(1.0)            # a write between two fusable steps: the cluster must not move past it
    return u * t + torch.tanh(u)


def test_a_write_between_steps_is_a_barrier():
    xs = [torch.randn(6, generator=torch.Generator().manual_seed(i)) for i in range(7)]
    fn = lambda x: inplace_between(x)  # noqa: E731
    f, out, ref = _second_call(fn, xs)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fused_call_checks_every_operand():
    # kernel: out = sigmoid(a) * b over width 4
    slots = [(fuse.IN, 0, 4, 0), (fuse.IN, 1, 4, 0), (fuse.SCRATCH, 0, 4, 0), (fuse.OUT, 0, 4, 0)]
    ops = [(fuse.SIGMOID, 2, 0, -1, 0.0), (fuse.MUL, 3, 2, 1, 0.0)]
    fc = fuse.FusedCall(_fused.Kernel(slots, ops, 2, 1), ["b", "c"], [4, 4], [4], 2)
    a, b = torch.randn(3, 4), torch.randn(4)
    (out,) = fc(3, None, a, b)
    torch.testing.assert_close(out, torch.sigmoid(a) * b, atol=1e-7, rtol=1e-6)
    view = torch.randn(3, 8)[:, 2:6]  # rows with a stride of 8: read in place
    torch.testing.assert_close(fc(3, None, view, b)[0], torch.sigmoid(view) * b, atol=1e-7, rtol=1e-6)
    assert fc(3, None, a.double(), b) is None                      # dtype
    assert fc(3, None, a.t().contiguous().t(), b) is None          # column stride != 1
    assert fc(2, None, a, b) is None                               # rows
    assert fc(3, None, a, torch.randn(3, 4)) is None               # shared operand of the wrong shape
    assert fc(3, None, a.to(torch.bfloat16).float().requires_grad_(), b) is None  # grad mode on
    with torch.no_grad():
        assert fc(3, None, a.clone().requires_grad_(), b) is not None
    assert fc(3, None, torch.empty(3, 4, device="meta"), b) is None  # not CPU
    assert fc(0, None, torch.empty(0, 4), b)[0].shape == (0, 4)
    assert fc(3, None, torch._neg_view(a), b) is None              # the negative bit of a view
    with torch.no_grad():
        assert fc(3, None, torch._efficientzerotensor((3, 4)), b) is None  # no storage


def test_kernel_rejects_malformed_programs():
    with pytest.raises(ValueError):
        _fused.Kernel([(fuse.IN, 0, 4, 0), (fuse.OUT, 0, 8, 0)], [(fuse.NEG, 1, 0, -1, 0.0)], 1, 1)  # widths
    with pytest.raises(ValueError):
        _fused.Kernel([(fuse.IN, 0, 4, 0)], [(fuse.NEG, 0, 0, -1, 0.0)], 1, 0)  # writes an input
    with pytest.raises(ValueError):
        _fused.Kernel([(fuse.IN, 0, 4, 0), (fuse.VIEW, 0, 4, 2)], [], 1, 0)  # view past its parent
    with pytest.raises(ValueError):
        _fused.Kernel([(fuse.IN, 0, 4, 0), (fuse.OUT, 0, 4, 0)], [(99, 1, 0, -1, 0.0)], 1, 1)  # opcode


def test_compile_blocks_is_deprecated():
    with pytest.warns(DeprecationWarning, match="compile_blocks"):
        autobatch(lambda x: x, compile_blocks=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autobatch(lambda x: x)


def test_treelstm_on_real_trees_runs_fused_ragged_levels():
    from batchcraft.data import load_sentences
    from batchcraft.models import suite

    task = suite.build("treelstm", load_sentences(limit=24), hidden=16)
    f = autobatch(task.fn)
    with torch.no_grad():
        f(task.instances)
        out = f(task.instances)
        ref = [task.fn(x) for x in task.instances]
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    s = f.stats
    assert s.fused_kernels > 0 and s.steps_fused >= 3 * s.fused_kernels // 2, s.summary()


# -- random elementwise blocks -----------------------------------------------------------------------

UNARY = ["sigmoid", "tanh", "relu", "neg", "exp_small"]
BINARY = ["add", "sub", "mul", "radd_s", "rsub_s", "mul_s", "sub_s"]


@st.composite
def programs(draw):
    """A straight-line block over x, y (d,) and a shared p (d,): a list of (op, a, b) on earlier values."""
    n = draw(st.integers(1, 9))
    prog = []
    for k in range(n):
        avail = 3 + k  # x, y, p, then the values made so far
        kind = draw(st.sampled_from(["u", "b", "b", "chunk"]))
        if kind == "u":
            prog.append((draw(st.sampled_from(UNARY)), draw(st.integers(0, avail - 1)), None))
        elif kind == "b":
            prog.append((draw(st.sampled_from(BINARY)), draw(st.integers(0, avail - 1)),
                         draw(st.integers(0, avail - 1))))
        else:
            prog.append(("chunk_swap", draw(st.integers(0, avail - 1)), None))
    outs = draw(st.lists(st.integers(0, 2 + n), min_size=1, max_size=3))
    return prog, outs


def _apply(op, a, b):
    if op == "sigmoid":
        return torch.sigmoid(a)
    if op == "tanh":
        return a.tanh()
    if op == "relu":
        return torch.nn.functional.relu(a)
    if op == "neg":
        return -a
    if op == "exp_small":
        return torch.exp(torch.tanh(a))
    if op == "add":
        return a + b
    if op == "sub":
        return torch.sub(a, b)
    if op == "mul":
        return a.mul(b)
    if op == "radd_s":
        return 0.25 + a
    if op == "rsub_s":
        return 1 - a
    if op == "mul_s":
        return a * 1.5
    if op == "sub_s":
        return a - 3
    if op == "chunk_swap":
        lo, hi = a.chunk(2, -1)
        return torch.cat([hi.sigmoid(), lo * 2.0], -1)
    raise ValueError(op)


def _block_of(program, p):
    prog, outs = program

    def body(x, y):
        vals = [x, y, p]
        for op, i, j in prog:
            vals.append(_apply(op, vals[i], vals[j] if j is not None else None))
        return tuple(vals[k] for k in outs)

    return static_block(body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), n=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_random_elementwise_blocks_match_eager(program, n, seed):
    g = torch.Generator().manual_seed(seed)
    d = 6
    p = torch.randn(d, generator=g)
    blk = _block_of(program, p)
    xs = [(torch.randn(d, generator=g), torch.randn(d, generator=g)) for _ in range(n)]
    fn = lambda xy: blk(*xy)  # noqa: E731
    f, out, ref = _second_call(fn, xs)
    for o, r in zip(out, ref):
        for a, b in zip(o, r):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert f.stats.fallbacks == 0


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), width=st.integers(1, 33), n=st.integers(1, 12), strided=st.booleans(),
       seed=st.integers(0, 1000))
def test_segment_sum_is_index_adds_bits(rows, width, n, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width * (2 if strided else 1), generator=g)
    if strided:
        x = x[:, width:]  # rows of a wider tensor: a row stride of 2 * width
    seg = torch.randint(0, n, (rows,), generator=g)
    out = fuse.segment_sum(x, seg, n)
    assert out is not None
    assert torch.equal(out, torch.zeros(n, x.shape[1]).index_add_(0, seg, x))
    if width > 1:
        assert fuse.segment_sum(torch.randn(rows, 2 * width)[:, ::2], seg, n) is None  # columns apart


def test_segment_sum_leaves_autograd_and_other_dtypes_to_torch():
    x = torch.randn(5, 3, requires_grad=True)
    seg = torch.tensor([0, 0, 1, 2, 2])
    assert fuse.segment_sum(x, seg, 3) is None           # needs autograd: index_add_ keeps the history
    with torch.no_grad():
        assert fuse.segment_sum(x, seg, 3) is not None
    assert fuse.segment_sum(x.detach().double(), seg, 3) is None
    assert fuse.segment_sum(x.detach(), seg.int(), 3) is None
    assert fuse.segment_sum(torch._neg_view(x.detach()), seg, 3) is None
    from batchcraft.autobatching import ragged

    y = ragged.seg_sum(x, seg, 3)
    assert y.requires_grad and torch.equal(y.detach(), torch.zeros(3, 3).index_add_(0, seg, x.detach()))


# -- the hostile pass's finds (docs/reliability.md #164-#167) -----------------------------------------

@static_block
def _pieces_after_a_later_value(x, y):
    g = x * 2.0 + y
    h = torch.tanh(y) * x
    a, b = g.chunk(2, -1)          # g's pieces are read outside; g is numbered after h (#164)
    return h, a, b


@static_block
def _pieces_of_a_piece(x, y):
    a, b = (x * y + 1.0).chunk(2, -1)
    c, d = a.chunk(2, -1)          # a piece of a piece, read outside (#165)
    return c.sigmoid() * 3.0, d, b


@static_block
def _dead_steps(x, y):
    lo, hi = x.chunk(2, -1)
    unused = torch.sigmoid(y) * 2.0  # computed, read by nothing (#166)
    return hi


@pytest.mark.parametrize("blk,fused", [(_pieces_after_a_later_value, True), (_pieces_of_a_piece, False),
                                       (_dead_steps, False)])
def test_planner_corner_cases_batch_and_match_eager(blk, fused):
    fn = lambda xy: blk(*xy)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(8, generator=g), torch.randn(8, generator=g)) for _ in range(9)]
    f = autobatch(fn)
    with torch.no_grad():
        for _ in range(3):
            out = f(xs)
            assert f.stats.fallbacks == 0 and not f.stats.fallback_reasons, f.stats.summary()
        ref = [fn(x) for x in xs]
    for o, r in zip(out, ref):
        for a, b in zip(o, r):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert (f.stats.fused_kernels > 0) == fused


def test_a_planning_failure_costs_the_fusion_not_the_batching(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(fuse, "plan", broken)
    torch.manual_seed(0)
    blk = Gates()
    fn = _gates_fn(blk)
    xs = _instances(6)
    f, out, ref = _second_call(fn, xs)
    _close(out, ref)
    s = f.stats
    assert s.fallbacks == 0 and s.fused_kernels == 0
    assert any("elementwise fusion off" in k and "planner bug" in k for k in s.fallback_reasons), s.fallback_reasons


def test_out_of_range_segment_ids_raise_as_index_add_does():
    x = torch.randn(3, 4)
    for seg in (torch.tensor([0, 1, 5]), torch.tensor([0, -1, 1]), torch.tensor([0, 1, 10 ** 12])):
        with pytest.raises(IndexError):
            fuse.segment_sum(x, seg, 2)
    slots = [(fuse.IN, 0, 4, 0), (fuse.OUT, 0, 4, 0)]
    fc = fuse.FusedCall(_fused.Kernel(slots, [(fuse.NEG, 1, 0, -1, 0.0)], 1, 1), ["g"], [4], [4], 1)
    with pytest.raises(IndexError):
        fc(3, torch.tensor([0, 2, 3]), x)       # row 3 of a 3-row operand
    torch.testing.assert_close(fc(3, torch.tensor([2, 0, 2]), x)[0], -x[[2, 0, 2]])


def test_dual_tensors_keep_their_tangents():
    # a forward-AD level: the kernels would drop tangents, so torch's calls run (reliability #172)
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    blk = Gates()
    fn = _gates_fn(blk)
    xs = _instances(5)
    tangents = [torch.randn(8) for _ in xs]
    f = autobatch(fn)
    with torch.no_grad(), fwAD.dual_level():
        duals = [(fwAD.make_dual(x, t), c) for (x, c), t in zip(xs, tangents)]
        f(duals)
        out = f(duals)
        ref = [fn(d) for d in duals]
        for o, r in zip(out, ref):
            for a, b in zip(o, r):
                pa, ta = fwAD.unpack_dual(a)
                pb, tb = fwAD.unpack_dual(b)
                torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
                assert ta is not None
                torch.testing.assert_close(ta, tb, atol=1e-5, rtol=1e-4)
        assert f.stats.fused_kernels == 0
        x = fwAD.make_dual(torch.randn(4, 3), torch.randn(4, 3))
        assert fuse.segment_sum(x, torch.tensor([0, 0, 1, 1]), 2) is None


def test_the_portable_loops_run_the_same_programs(tmp_path):
    """Without AVX-512 (forced here: BATCHCRAFT_FUSED_PORTABLE=1) the kernels' portable loops run."""
    import os
    import subprocess
    import sys

    script = tmp_path / "portable.py"
    script.write_text(
        "import sys, torch\n"
        "sys.path.insert(0, %r)\n"
        "from batchcraft.autobatching import _fused\n"
        "import test_fuse as T\n"
        "assert _fused.vector_maths == 'portable', _fused.vector_maths\n"
        "T.test_block_tail_runs_fused_and_matches_eager('python')\n"
        "T.test_treelstm_on_real_trees_runs_fused_ragged_levels()\n"
        "print('ok')\n" % os.path.dirname(__file__))
    env = dict(os.environ, BATCHCRAFT_FUSED_PORTABLE="1")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


_MATHS_SCRIPT = """
import sys, torch
from batchcraft.autobatching import _fused, fuse
g = torch.Generator().manual_seed(1)
parts = [torch.randn(60000, generator=g) * s for s in (0.1, 1, 5, 30, 100)]
bits = torch.randint(0, 2**32, (150000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 88.72283935546875, 88.7228,
                      88.73, -103.97208, -103.972, -103.98, 0.625, -0.625, 0.6249999, 1e-40, -1e-40,
                      3.4e38, -3.4e38, 44.36, -44.36, -87.3, -88.0, -100.0, 1e-8, -1e-8])
x = torch.cat(parts + [bits, edges.repeat(8)])
out = {"maths": _fused.vector_maths}
for w in (8, 13):  # whole vectors; vectors and a scalar tail
    xw = x[: x.numel() // w * w].view(-1, w).contiguous()
    for code in (fuse.SIGMOID, fuse.TANH, fuse.EXP):
        k = _fused.Kernel([(fuse.IN, 0, w, 0), (fuse.OUT, 0, w, 0)], [(code, 1, 0, -1, 0.0)], 1, 1)
        out[(w, code)] = fuse.FusedCall(k, ["b"], [w], [w], 1)(xw.shape[0], None, xw)[0]
torch.save(out, sys.argv[1])
"""


def test_the_avx2_maths_agree_with_the_portable_loops(tmp_path):
    """AVX2's 8-lane exp, sigmoid and tanh (CPUs without AVX-512) stay within 4 units in the last
    place of the portable loops (FMA rounds once where they round twice), with the same NaNs,
    infinities, zeros and signs: random values at several scales, random bit patterns
    (denormals, infinities, NaNs) and the clamps' edges, in whole vectors and scalar tails.
    """
    import os
    import subprocess
    import sys

    if _fused is None or _fused.vector_maths == "portable":
        pytest.skip("no AVX2 on this CPU (or no compiler): only the portable loops exist")
    script = tmp_path / "maths.py"
    script.write_text(_MATHS_SCRIPT)
    results = {}
    for cap in ("avx2", "1"):
        path = tmp_path / f"{cap}.pt"
        r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, BATCHCRAFT_FUSED_PORTABLE=cap))
        assert r.returncode == 0, r.stderr[-2000:]
        results[cap] = torch.load(path)
    vec, port = results["avx2"], results["1"]
    assert vec["maths"] == "avx2" and port["maths"] == "portable"
    for key, a in vec.items():
        if key == "maths":
            continue
        b = port[key]
        assert torch.equal(a.isnan(), b.isnan()), key
        ok = ~a.isnan()
        a, b = a[ok], b[ok]
        assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()]), key
        assert torch.equal(a == 0, b == 0) and torch.equal(a.signbit(), b.signbit()), key
        ulps = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 4, (key, int(ulps.max()))


# -- inputs read in place through their index (gather.Rows) ----------------------------------------

def test_fused_call_reads_rows_of_a_buffer_through_their_index():
    from batchcraft.autobatching.gather import Rows

    slots = [(fuse.IN, 0, 4, 0), (fuse.IN, 1, 4, 0), (fuse.SCRATCH, 0, 4, 0), (fuse.OUT, 0, 4, 0)]
    ops = [(fuse.SIGMOID, 2, 0, -1, 0.0), (fuse.MUL, 3, 2, 1, 0.0)]
    fc = fuse.FusedCall(_fused.Kernel(slots, ops, 2, 1), ["b", "b"], [4, 4], [4], 2)
    buf, other = torch.randn(6, 4), torch.randn(3, 4)
    idx = torch.tensor([5, 0, 5])
    (out,) = fc(3, None, Rows(buf, idx), other)
    torch.testing.assert_close(out, torch.sigmoid(buf[idx]) * other, atol=1e-7, rtol=1e-6)
    wide = torch.randn(6, 10)[:, 3:7]  # rows with a stride: read in place too
    torch.testing.assert_close(fc(3, None, Rows(wide, idx), other)[0], torch.sigmoid(wide[idx]) * other,
                               atol=1e-7, rtol=1e-6)
    assert fc(3, None, Rows(buf, torch.tensor([0, 1])), other) is None            # index length
    assert fc(3, None, Rows(buf.double(), idx), other) is None                    # dtype
    assert fc(3, None, Rows(buf, idx.to(torch.int32)), other) is None             # index dtype
    assert fc(3, None, Rows(torch.randn(6, 5), idx), other) is None               # width
    with pytest.raises(IndexError):
        fc(3, None, Rows(buf, torch.tensor([0, 6, 1])), other)                    # row 6 of 6
    shared = fuse.FusedCall(_fused.Kernel(slots, ops, 2, 1), ["b", "c"], [4, 4], [4], 2)
    assert shared(3, None, other, Rows(buf, idx)) is None                         # only as rows


def _tree_cell():
    @static_block
    class Cell(torch.nn.Module):  # a child-sum cell: its input and the children's c are only read by
        def __init__(self):       # elementwise steps, so they arrive as Rows
            super().__init__()
            self.U = torch.nn.Linear(6, 18, bias=False)
            self.F = torch.nn.Linear(6, 6, bias=False)

        def forward(self, iou_x, f_x, hs, cs):
            iou = iou_x
            if hs:
                h = torch.stack(hs, dim=-2)
                c = torch.stack(cs, dim=-2)
                iou = iou + self.U(h.sum(-2))
                f = torch.sigmoid(f_x.unsqueeze(-2) + self.F(h))
            i, o, u = iou.chunk(3, dim=-1)
            c_new = torch.sigmoid(i) * torch.tanh(u)
            if hs:
                c_new = c_new + (f * c).sum(-2)
            return torch.sigmoid(o) * torch.tanh(c_new), c_new

    return Cell()


def _tree_fn(cell, proj):
    def node(tree):
        kids = [node(k) for k in tree[1]]
        x = proj(torch.tensor(tree[0]))
        return cell(x[:18], x[18:], [h for h, _ in kids], [c for _, c in kids])

    return lambda tree: node(tree)[0]


def _trees(n, seed):
    g = torch.Generator().manual_seed(seed)

    def tree(depth):
        k = int(torch.randint(0, 3 if depth < 3 else 1, (), generator=g))
        return (int(torch.randint(0, 5, (), generator=g)), [tree(depth + 1) for _ in range(k)])

    return [tree(0) for _ in range(n)]


def _tree_case(seed, n):
    """(per-instance fn, trees): the child-sum cell over random trees, with embedded token inputs."""
    torch.manual_seed(seed)
    cell, proj = _tree_cell(), static_block(torch.nn.Embedding(5, 24))
    return _tree_fn(cell, proj), _trees(n, seed)


def _count_rows(monkeypatch):
    from batchcraft.autobatching import gather

    made = [0, 0]
    real_init, real_mat = gather.Rows.__init__, gather.Rows.materialize

    def init(self, b, i):
        made[0] += 1
        real_init(self, b, i)

    def mat(self):
        made[1] += 1
        return real_mat(self)

    monkeypatch.setattr(gather.Rows, "__init__", init)
    monkeypatch.setattr(gather.Rows, "materialize", mat)
    return made


def test_inputs_only_kernels_read_are_not_gathered(monkeypatch):
    fn, trees = _tree_case(0, 12)
    made = _count_rows(monkeypatch)
    f = autobatch(fn)
    with torch.no_grad():
        f(trees)
        made[0] = 0
        out = f(trees)
        ref = [fn(t) for t in trees]
    _close([(o,) for o in out], [(r,) for r in ref])
    assert f.stats.fused_kernels > 0 and f.stats.fused_declined == 0
    assert made[0] > 0 and made[1] == 0  # gathers left as rows, none copied after all
    assert f.stats.rows_in_place == made[0] and "passed as rows of their buffers" in f.stats.summary()


@pytest.mark.parametrize("how", ["forward_ad_level", "group_fails"])
def test_rows_are_copied_where_the_kernels_do_not_run(how, monkeypatch):
    # a forward-AD level makes every kernel decline, and since reliability #209 no rows are handed
    # out under one at all (raw row reads carry no tangent): the inputs are gathered as before the
    # kernels existed; a group whose batched run fails runs one instance at a time on copied rows
    import torch.autograd.forward_ad as fwAD

    from batchcraft.autobatching import lower

    fn, trees = _tree_case(1, 12)
    made = _count_rows(monkeypatch)
    f = autobatch(fn)
    with torch.no_grad():
        f(trees)
        if how == "forward_ad_level":
            before = list(made)
            with fwAD.dual_level():
                out = f(trees)
            assert f.stats.fused_declined > 0 and f.stats.fallbacks == 0  # the unfused branches ran
            assert made == before and f.stats.rows_in_place == 0  # no rows handed out under the level
            ref = [fn(t) for t in trees]
            _close([(o,) for o in out], [(r,) for r in ref])
            assert made[0] > 0  # (outside the level they were)
            return
        else:
            real = lower.Runner.__call__

            def failing(self, n, ins, *rest):
                if any(type(x).__name__ == "Rows" for x in (*ins, *(rest[0] if rest else ()))):
                    raise RuntimeError("batched run failed")
                return real(self, n, ins, *rest)

            monkeypatch.setattr(lower.Runner, "__call__", failing)
            out = f(trees)
            assert f.stats.fallbacks > 0
        ref = [fn(t) for t in trees]
    _close([(o,) for o in out], [(r,) for r in ref])
    assert made[0] > 0 and made[1] > 0


def test_rows_taken_are_published_only_after_the_programs_that_take_them():
    # another thread reads runner.taken to decide whether to pass Rows: it must not be visible
    # before the programs that take them exist
    from batchcraft.autobatching import lower

    fn, trees = _tree_case(2, 12)
    f = autobatch(fn)
    seen = []
    real = lower.Runner._build

    def build(self):
        out = real(self)
        seen.append(self.taken is not out[3])  # not yet published when the lowering returns
        return out

    lower.Runner._build = build
    try:
        with torch.no_grad():
            f(trees)
            first = f.stats.rows_in_place
    finally:
        lower.Runner._build = real
    assert seen and all(seen)
    assert first > 0  # the first call's runs already read rows in place (lowered before the gathers)
    with torch.no_grad():
        out = f(trees)
    _close([(o,) for o in out], [(fn(t),) for t in trees])


def test_rows_a_program_no_longer_takes_are_copied_first():
    # the caller gathered by one lowering, the program running is another's (a thread lowered it
    # again after a step failed): rows it does not take arrive as tensors
    from batchcraft.autobatching.gather import Rows
    from batchcraft.autobatching.lower import Taken, _conform

    buf = torch.randn(6, 4)
    idx = torch.tensor([4, 0, 2])
    ins = [Rows(buf, idx), Rows(buf, idx), torch.ones(3, 4), None]
    rags = [Rows(buf, idx)]
    keep = Taken(frozenset({1}), frozenset(), frozenset())
    got, grags = _conform(ins, rags, keep)
    assert type(got[0]) is torch.Tensor and torch.equal(got[0], buf[idx])
    assert got[1] is ins[1] and got[2] is ins[2] and got[3] is None
    assert type(grags[0]) is torch.Tensor and torch.equal(grags[0], buf[idx])


def test_first_run_uses_the_fused_kernels_and_lowers_once():
    # one lowering serves the checked first run and the fast program: a first call lowers each
    # program once, and its first runs already call the fused kernels
    from batchcraft.autobatching import lower

    fn, trees = _tree_case(4, 12)
    f = autobatch(fn)
    built = []
    real = lower.Runner._build

    def build(self):
        built.append(self)
        return real(self)

    lower.Runner._build = build
    try:
        with torch.no_grad():
            out = f(trees)
    finally:
        lower.Runner._build = real
    assert built and len(built) == len({id(r) for r in built})  # each program lowered once
    assert f.stats.fused_kernels > 0 and f.stats.fallbacks == 0
    _close([(o,) for o in out], [(fn(t),) for t in trees])


def test_a_program_without_checks_that_fails_to_build_leaves_the_checked_one(monkeypatch):
    from batchcraft.autobatching import lower

    fn, trees = _tree_case(5, 10)
    real = lower.compile_program

    def compile_program(src, name):
        if "_chk(" not in src:
            raise SyntaxError("a lowering bug")
        return real(src, name)

    monkeypatch.setattr(lower, "compile_program", compile_program)
    f = autobatch(fn)
    with torch.no_grad():
        for _ in range(2):
            out = f(trees)
            _close([(o,) for o in out], [(fn(t),) for t in trees])
    assert any("runs its checked program (SyntaxError: a lowering bug)" in r for r in f.stats.fallback_reasons)


def _token_gate():
    """A static block over a token and a state, (8,): an embedding, a linear, a gated update."""
    torch.manual_seed(3)
    emb, lin = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 16)

    @static_block
    def gate(w, x):
        p, q = lin(emb(w)).chunk(2)
        return torch.sigmoid(p) * torch.tanh(q) + x

    return gate


def test_vmap_over_a_call_declines_the_kernels_instead_of_failing_the_groups():
    # reliability #186 (hostile helper, stop 38; present before): under torch.func.vmap the
    # operands are batched wrappers without storage; data_ptr() raised and every fused group ran
    # one instance at a time. The kernels now decline and the programs' torch calls run.
    gate = _token_gate()

    def fn(inst):
        toks, x = inst
        return torch.stack([gate(torch.tensor(t), x) for t in toks]).sum(0)

    toks = [[(i * 7 + j) % 6 for j in range(10)] for i in range(8)]
    f = autobatch(fn)
    xb = torch.randn(3, 8, 8)
    with torch.no_grad():
        f(list(zip(toks, xb[0])))
        got = torch.func.vmap(lambda X: torch.stack(f(list(zip(toks, X.unbind(0))))))(xb)
        ref = torch.func.vmap(lambda X: torch.stack([fn(i) for i in zip(toks, X.unbind(0))]))(xb)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    # (the programs of a call under a transform are its own since #190: made there, they may
    # hold no fused kernel to decline; none may run on the batched wrappers)
    assert f.stats.fallbacks == 0 and (f.stats.fused_declined > 0 or f.stats.fused_kernels == 0)


def _out_of_order_case(program, n, k, seed) -> int:
    """A block's inputs made by another block, read in two orders (reversed per instance, then as
    made): their gathers are index plans, and inputs only the kernels read are passed as Rows
    (read through the index). Checked against eager; returns ``stats.rows_in_place``."""
    g = torch.Generator().manual_seed(seed)
    d = 6
    p = torch.randn(d, generator=g)
    blk = _block_of(program, p)
    lin = torch.nn.Linear(d, 2 * d)
    make = static_block(lambda x: lin(x).chunk(2))

    def fn(xs):
        made = [make(x) for x in xs]
        # read twice, in two orders: no one layout of make's rows makes both reads views
        return [blk(a, b) for a, b in reversed(made)] + [blk(a, b) for a, b in made]

    xs = [[torch.randn(d, generator=g) for _ in range(k)] for _ in range(n)]
    f = autobatch(fn)
    with torch.no_grad():
        f(xs)
        out = f(xs)
        ref = [fn(x) for x in xs]
    for o, r in zip(out, ref):
        for a, b in zip(o, r):
            for u, v in zip(a, b):
                torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert f.stats.fallbacks == 0
    return f.stats.rows_in_place


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), n=st.integers(1, 7), k=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_random_blocks_reading_rows_out_of_order_match_eager(program, n, k, seed):
    _out_of_order_case(program, n, k, seed)


def test_the_out_of_order_case_passes_rows():
    # the property test above is only worth its name if its case reaches the Rows path
    assert _out_of_order_case(([("sigmoid", 0, None), ("mul", 3, 1)], [4]), 4, 3, 1) > 0


@pytest.mark.parametrize("arena_takes", [True, False])
def test_kernels_write_program_outputs_into_the_arena_rows(arena_takes, monkeypatch):
    # a tree cell's (h, c) come out of its last fused kernel: written straight into the rows of the
    # flush's output arena (no copy afterwards). Where the arena does not take a group's outputs,
    # they get rows of their own: the next group's writes into those arena rows must not reach them
    from batchcraft.autobatching import execute
    from batchcraft.data import load_sentences
    from batchcraft.models import suite

    written = []
    original = fuse.FusedCall._checked_run

    def spy(self, rows, seg, xs, dest=None, dmap=()):
        out = original(self, rows, seg, xs, dest, dmap)
        if dest is not None and out is not None:
            written.extend(o.data_ptr() == dest[j].data_ptr() for o, j in zip(out, dmap) if j >= 0)
        return out

    monkeypatch.setattr(fuse.FusedCall, "_checked_run", spy)
    if not arena_takes:
        monkeypatch.setattr(execute.Executor, "_into_arena", lambda self, a, outs, n: None)
    task = suite.build("treelstm", load_sentences(limit=24), hidden=16)
    f = autobatch(task.fn)
    with torch.no_grad():
        out = f(task.instances)
        ref = [task.fn(x) for x in task.instances]
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert written and all(written)
    # each output its own rows: an edit of one instance's output changes no other's
    before = [o.clone() for o in out]
    out[0].add_(1.0)
    assert all(torch.equal(o, b) for o, b in zip(out[1:], before[1:]))
    # under autograd nothing is written in place (no arenas): the kernels decline
    written.clear()
    f(task.instances)
    assert not written


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_a_chain_of_blocks_under_a_transform_matches_eager(transform):
    # reliability #193 (stop 40; new at stop 39): a group's outputs copied into the flush's
    # output arena read data_ptr() of torch.func's batched values, which have no storage: the
    # call raised under vmap. Wrapped outputs now stay out of the arenas.
    gate = _token_gate()

    def fn(inst):
        toks, x = inst
        for t in toks:
            x = gate(torch.tensor(t), x)
        return x

    toks = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    xb = torch.randn(3, 3, 8)
    f = autobatch(fn)

    def run(g):
        return lambda X: torch.stack(g([(t, x) for t, x in zip(toks, X.unbind(0))]))

    with torch.no_grad():
        f(list(zip(toks, xb[0])))
        if transform == "vmap":
            got = torch.func.vmap(run(f))(xb)
            ref = torch.func.vmap(run(lambda insts: [fn(i) for i in insts]))(xb)
        else:
            tangent = torch.randn(3, 8)
            got = torch.func.jvp(run(f), (xb[0],), (tangent,))
            ref = torch.func.jvp(run(lambda insts: [fn(i) for i in insts]), (xb[0],), (tangent,))
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    assert f.stats.fallbacks == 0


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_two_output_blocks_writing_into_arenas_under_a_transform_match_eager(core, transform):
    # hostile helper, stop 40 (#193's second half): the fused kernels' arena rows (dest) were
    # compared with the outputs by data_ptr(), which a transform's values do not have
    @static_block
    def mix(a, b):
        return torch.tanh(a + b), a * b

    def fn(x):
        a, b = x, x * 0.5
        for _ in range(3):
            a, b = mix(a, b)
        return a

    xb = torch.randn(2, 3, 4)

    def run(g):
        body = lambda X: torch.stack(g(list(X.unbind(0))))  # noqa: E731
        if transform == "vmap":
            return torch.func.vmap(body)(xb)
        return torch.func.jvp(body, (xb[0],), (xb[1],))

    f = autobatch(fn, core=core)
    with torch.no_grad():
        f(list(xb[0].unbind(0)))
        torch.testing.assert_close(run(f), run(lambda insts: [fn(x) for x in insts]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("view", ["tail", "row", "chunk", "narrow"])
def test_a_block_output_viewing_a_fused_output_keeps_its_rows(levels, view):
    # reliability #325 (a hostile helper, stop 52): the fused kernel wrote h into the group's
    # arena rows, the arena declined the group (its outputs alias), and only outputs starting at
    # a row's start were copied: h[4:] stayed a view of rows the next group of the block wrote over
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    views = {"tail": lambda h: h[4:], "row": lambda h: h[5], "chunk": lambda h: h.chunk(2)[1],
             "narrow": lambda h: h.narrow(0, 2, 4)}
    part = views[view]

    @static_block
    def blk(x, y):
        h = torch.tanh(x @ w + y)
        return h, part(h)

    def fn(inst):
        x, y = inst
        outs = []
        for _ in range(levels):
            x, s = blk(x, y)
            outs.append(s)
        return outs

    g = torch.Generator().manual_seed(5)
    xs = [(torch.randn(8, generator=g), torch.randn(8, generator=g)) for _ in range(5)]
    f = autobatch(fn)
    with torch.no_grad():
        for _ in range(2):  # the first run and the unchecked program
            out = f(xs)
            for o, x in zip(out, xs):
                for a, b in zip(o, fn(x)):
                    torch.testing.assert_close(a, b)


def test_a_first_run_made_again_counts_its_fused_kernels_once():
    # a step failing in the first run (an old-style autograd.Function: no vmap rule) after a
    # fused kernel ran: the run is made again with the step per instance, and the kernel counts once
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    torch.manual_seed(1)
    w = torch.randn(8, 8)

    @static_block
    def blk(x):
        h = torch.sigmoid(x @ w) * torch.tanh(x)
        return Twice.apply(h)

    xs = [torch.randn(8) for _ in range(6)]
    f = autobatch(blk)
    with torch.no_grad():
        first = f(xs)
        counts = (f.stats.fused_kernels, f.stats.steps_fused, f.stats.fallbacks > 0)
        f(xs)
        again = (f.stats.fused_kernels, f.stats.steps_fused, f.stats.fallbacks > 0)
    assert counts == again and counts[0] > 0 and counts[2]
    for o, x in zip(first, xs):
        torch.testing.assert_close(o, Twice.apply(torch.sigmoid(x @ w) * torch.tanh(x)))
