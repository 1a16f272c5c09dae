"""Differential fuzzing: random per-instance programs, batched vs eager (values and gradients).

Programs come from :mod:`fuzzing` (hypothesis strategies, so failures shrink to small programs).
Each example draws a program, a batch of random instances (0 to 9 of them, with different
sequence lengths, trees, loop counts and branch decisions) and the runtime options (scheduler,
fibers, max_pending); it runs the program eagerly, instance by instance, and through
``batchcraft.autobatch``, and compares every output (shape, dtype, value) and the gradients of a
random weighted sum of the outputs with respect to every parameter and every instance input that
requires grad.

Profiles (environment ``BATCHCRAFT_FUZZ_PROFILE``):

* ``fast`` (default, part of ``make test``): a fixed, derandomized set of examples, well under
  a minute on 2 cores.
* ``long`` (``make fuzz``): at least 5,000 random programs (4,200 + 900 with D = 1 + 300 with
  8 to 24 instances), each run on every available core (the C core and the pure-Python
  reference), with ragged blocks on or off, hoisting on or off and the default or oneDNN matrix
  multiplies. ``BATCHCRAFT_FUZZ_STATS=path.json`` writes the counts (programs per core, instances,
  operations recorded, batched calls, syncs) there.

Triage knobs: ``BATCHCRAFT_FUZZ_EXAMPLES=N`` sets the examples of the main test;
``BATCHCRAFT_FUZZ_NO_SHRINK=1`` reports failures unshrunk (fast, for a first look).
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings, strategies as st

from batchcraft import autobatch
from equivalence import CORES, flat_tensors

from fuzzing import CHECK_REQUIRES_GRAD, MARGIN, Params, compile_program, count_statements, instance_specs, make_instance, programs

PROFILE = os.environ.get("BATCHCRAFT_FUZZ_PROFILE", "fast")
if PROFILE not in ("fast", "long"):
    raise ValueError(f"BATCHCRAFT_FUZZ_PROFILE must be 'fast' or 'long', got {PROFILE!r}")
LONG = PROFILE == "long"

# examples per test; the long profile's total is >= 5,000 programs
N_MAIN = int(os.environ.get("BATCHCRAFT_FUZZ_EXAMPLES", 4200 if LONG else 180))
N_SMALL_D = 900 if LONG else 40
N_LARGE = 300 if LONG else 12
_common = dict(deadline=None, database=None, derandomize=not LONG, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
if os.environ.get("BATCHCRAFT_FUZZ_NO_SHRINK"):
    _common.update(phases=(Phase.explicit, Phase.generate), derandomize=False)

COUNTS = {"programs": 0, "instances": 0, "statements": 0, "ops_recorded": 0, "batched_calls": 0,
          "syncs": 0, "eager_ops": 0, "fallbacks": 0, "discarded_close_branches": 0,
          "output_tensors_compared": 0, "gradients_compared": 0}
MIN_BRANCH_MARGIN = 1e-3
_TOL_BF16 = dict(atol=3e-2, rtol=3e-2)   # values, programs with a bf16 autocast region
_GTOL_BF16 = dict(atol=5e-2, rtol=5e-2)  # their gradients
_BF16_ULP = 2.0 ** -7  # bfloat16's spacing at 1.0 (8 significant bits)


def _write_counts() -> None:
    path = os.environ.get("BATCHCRAFT_FUZZ_STATS")
    if path:
        with open(path, "w") as fh:
            json.dump(dict(COUNTS, profile=PROFILE, elapsed_s=round(time.perf_counter() - _T0, 1)), fh, indent=1)


_T0 = time.perf_counter()


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    _write_counts()


def _non_tensors(x):
    if isinstance(x, torch.Tensor):
        return "T"
    if isinstance(x, dict):
        return {k: _non_tensors(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x).__name__, [_non_tensors(v) for v in x]
    return x


def _buffers(P):
    return {k: v.detach().clone() for k, v in P.named_buffers()}


def _restore(P, snap):
    # new buffer objects (the eager graph may hold the old ones for its backward)
    for k in snap:
        mod_name, _, attr = k.rpartition(".")
        mod = P.get_submodule(mod_name) if mod_name else P
        setattr(mod, attr, snap[k].clone())


def check_program(program, specs, scheduler="depth", fibers=True, max_pending=None, seed=0, cores=None,
                  ragged=True, hoist=True, kernels="default", packed_order=True, device=None, inference=False):
    """Run ``program`` eagerly and batched (on each core of ``cores``) on the instances of ``specs``;
    assert equal values, dtypes, requires_grad, gradients and final module buffers.

    With ``packed_order`` every recurrence is reordered (its size threshold lowered to 2 nodes,
    so the fuzzer's few instances reach it); without, none is. With ``device`` (``"cuda"``) both
    runs happen under ``with torch.device(device)``: parameters, instances and every tensor the
    program makes live there, as in a user's ``torch.set_default_device`` program. With
    ``inference`` both runs happen under ``torch.no_grad()`` (values only): the batched programs'
    elementwise steps then run as fused kernels (``fuse.py``), which autograd turns off."""
    from contextlib import nullcontext

    from batchcraft.autobatching import chains, dedup, execute, gather, order

    min_nodes, min_chain, min_order = order.MIN_NODES, chains.MIN_NODES, execute.ORDER_MIN_ROW_BYTES
    min_dedup, min_refs = dedup.MIN_NODES, gather.ROW_REFS_MIN_BYTES
    order.MIN_NODES = chains.MIN_NODES = dedup.MIN_NODES = 2  # the fuzzer's few instances reach them
    execute.ORDER_MIN_ROW_BYTES = 1  # every group runs in its largest input's source order
    gather.ROW_REFS_MIN_BYTES = 0  # every per-node matrix only products read is read in place (rowmm.py)
    try:
        for core in cores or [CORES[0]]:
            with torch.device(device) if device is not None else nullcontext():
                with torch.no_grad() if inference else nullcontext():
                    f = _check_one(program, specs, scheduler, fibers, max_pending, seed, core, ragged, hoist,
                                   kernels, packed_order)
            COUNTS[f"programs_{core}"] = COUNTS.get(f"programs_{core}", 0) + 1
            fused = sum(v for k, v in f.stats.groups_by_rule.items() if k.startswith("fused_"))
            COUNTS["fused_chain_calls"] = COUNTS.get("fused_chain_calls", 0) + fused
            COUNTS["groups_reordered"] = COUNTS.get("groups_reordered", 0) + f.stats.groups_reordered
            COUNTS["steps_fused"] = COUNTS.get("steps_fused", 0) + f.stats.steps_fused
            for k in ("groups_consumer_ordered", "groups_deduplicated", "rows_in_place", "groups_merged",
                      "recurrences_stepwise", "rows_dead"):
                COUNTS[k] = COUNTS.get(k, 0) + getattr(f.stats, k)
    finally:
        order.MIN_NODES, chains.MIN_NODES, execute.ORDER_MIN_ROW_BYTES = min_nodes, min_chain, min_order
        dedup.MIN_NODES, gather.ROW_REFS_MIN_BYTES = min_dedup, min_refs
    return f


def _check_one(program, specs, scheduler, fibers, max_pending, seed, core, ragged, hoist, kernels, packed_order):
    d = program[0]
    P = Params(d, seed)
    fn = compile_program(program, P)
    instances = [make_instance(s, d) for s in specs]
    snap = _buffers(P)

    MARGIN.tracking, MARGIN.smallest = True, math.inf
    P.memo.clear()
    eager_error = None
    try:
        ref = [fn(inst) for inst in instances]
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        # the program is invalid in eager too (e.g. torch.mv of a float32 matrix and a bfloat16
        # vector under autocast, which PyTorch itself refuses): batched, it must fail as well
        eager_error = exc
    finally:
        MARGIN.tracking = False
    if eager_error is not None:
        _restore(P, snap)
        f = autobatch(fn, scheduler=scheduler, fibers=fibers, max_pending=max_pending, core=core,
                      ragged=ragged, hoist=hoist, kernels=kernels, packed_order=packed_order)
        P.memo.clear()
        with pytest.raises(Exception):
            f(instances)
        COUNTS["eager_errors"] = COUNTS.get("eager_errors", 0) + 1
        return f
    if MARGIN.smallest < MIN_BRANCH_MARGIN:
        COUNTS["discarded_close_branches"] += 1
        assume(False)  # a float branch (or a max's best two) within rounding: not a fair comparison
    eager_buffers = _buffers(P)
    _restore(P, snap)

    f = autobatch(fn, scheduler=scheduler, fibers=fibers, max_pending=max_pending, core=core, ragged=ragged,
                  hoist=hoist, kernels=kernels, packed_order=packed_order)
    P.memo.clear()  # lazy values cached across instances must come from this run
    out = f(instances)
    COUNTS["programs"] += 1
    tol = _TOL_BF16 if P.autocast_used else dict(atol=1e-4, rtol=1e-4)
    for k, v in _buffers(P).items():
        torch.testing.assert_close(v, eager_buffers[k], **tol, msg=lambda m, k=k: f"buffer {k}: {m}")
    if COUNTS["programs"] % 50 == 0:
        _write_counts()  # a long run cut short by a time limit still reports its counts
    COUNTS["instances"] += len(instances)
    COUNTS["statements"] += count_statements(program[1])
    for k in ("ops_recorded", "batched_calls", "syncs", "eager_ops", "fallbacks"):
        COUNTS[k] += getattr(f.stats, k)

    assert isinstance(out, list) and len(out) == len(ref)
    wrt = [p for p in P.parameters()] + [P.buf]
    for blk in P.blocks.values():
        if isinstance(blk, torch.nn.Module):
            wrt += list(blk.parameters())
    wrt += [inst["x"] for inst in instances if inst["x"].requires_grad]
    g = torch.Generator().manual_seed(seed + 1)
    weights = [[torch.randn(t.shape, generator=g, device="cpu").to(t.device) for t in flat_tensors(r)] for r in ref]

    def loss(outs):
        total = torch.zeros(())
        for o, ws in zip(outs, weights):
            for t, w in zip(flat_tensors(o), ws):
                if t.is_floating_point() and t.requires_grad:
                    total = total + (t * w).sum()
        return total

    cache: list = []

    def reference():
        """Eager outputs and gradients with autocast off (float32): None if they differ in structure."""
        if not cache:
            cache.append(_float32_reference(fn, P, snap, instances, ref, loss, wrt))
        return cache[0]

    ge_cache: list = []

    def eager_grads():
        """Eager's gradients of the loss w.r.t. ``wrt`` (its graph kept: the nudged runs may ask first)."""
        if not ge_cache:
            l_e = loss(ref)
            ge_cache.append(torch.autograd.grad(l_e, wrt, allow_unused=True, retain_graph=True)
                            if l_e.requires_grad else None)
        return ge_cache[0]

    sens: list = []

    def sensitivity():
        """Per output, how far eager's own float32 value moves when the inputs move one ulp."""
        if not sens:
            sens.append(_sensitivity(fn, P, snap, instances, ref, loss, wrt, eager_grads))
        return sens[0]

    for i, (o, r) in enumerate(zip(out, ref)):
        assert _non_tensors(o) == _non_tensors(r), f"instance {i}: output structure differs"
        for k, (a, b) in enumerate(zip(flat_tensors(o), flat_tensors(r))):
            assert type(a) is torch.Tensor, f"instance {i}: output is {type(a).__name__}"
            assert a.shape == b.shape, f"instance {i}: shape {tuple(a.shape)} vs eager {tuple(b.shape)}"
            assert a.dtype == b.dtype, f"instance {i}: dtype {a.dtype} vs eager {b.dtype}"
            if CHECK_REQUIRES_GRAD:
                assert a.requires_grad == b.requires_grad, f"instance {i}: requires_grad differs from eager"
            _assert_close(a, b, tol, f"instance {i}", lambda i=i, k=k: reference()[0][i][k] if reference() else None,
                          lambda i=i, k=k: sensitivity()[0][i][k] if sensitivity() else None)
            COUNTS["output_tensors_compared"] += 1

    # gradients: w.r.t. shared parameters (incl. module blocks) and instance inputs
    l_e, l_b = loss(ref), loss(out)
    if not l_e.requires_grad:
        return f
    ge = eager_grads()
    assert l_b.requires_grad, "batched outputs do not require grad but eager ones do"
    gb = torch.autograd.grad(l_b, wrt, allow_unused=True)
    for j, (a, b) in enumerate(zip(gb, ge)):
        a, b = _dense(a, wrt[j]), _dense(b, wrt[j])
        gtol = _GTOL_BF16 if P.autocast_used else dict(atol=2e-4, rtol=1e-3)
        _assert_close(a, b, gtol, f"gradient of input {j} {tuple(wrt[j].shape)}",
                      lambda j=j: reference()[1][j] if reference() else None,
                      lambda j=j: sensitivity()[1][j] if sensitivity() and sensitivity()[1] else None)
        COUNTS["gradients_compared"] += 1
    return f


def _assert_close(a, b, tol, what, float32_value, sensitivity=None):
    """``a`` (batched) close to ``b`` (eager); under bf16 autocast, else as close to the float32
    result as eager's bf16 value is (within a factor 2); in float32, else within twice the distance
    eager's own value moves when the instances' inputs move by one float32 ulp.

    Batching moves bf16 rounding: a shared parameter's gradient is one bf16 reduction over all
    instances rather than per-instance bf16 gradients summed in float32, so where a sum cancels
    (bug #31: 0.96 eager, 1.08 batched, 0.79 in float32) neither bf16 value is near the other.
    ``float32_value()`` returns the float32 eager value (None when that run took other branches).
    The bound also allows one bf16 ulp of the tensor's largest entry: a weight gradient's entries
    are sums over the same rows, whose rounding scales with the largest of them, so a small entry
    beside large ones moves by more than its own size allows (#248: -0.226 batched, -0.320 eager,
    -0.343 in float32, beside entries of 16, where one bf16 ulp is 0.125).

    Batching also moves float32 rounding (another summation order in a batched GEMM), which a
    chaotic program amplifies past any fixed tolerance (#215: a training-mode batch norm, GRU
    cells and a loop of ``sin``; a one-ulp change of ``x`` moves eager's own output by 2.0e-4,
    the batched one differed by 2.0e-4). ``sensitivity()`` returns that move for this output (the
    larger of one ulp up and one down; None when a nudged run took other branches).
    """
    try:
        torch.testing.assert_close(a, b, **tol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        if tol is _TOL_BF16 or tol is _GTOL_BF16:
            r = float32_value() if float32_value is not None else None
            if r is None or r.shape != a.shape:
                raise
            r = r.double()
            err_a, err_b = (a.double() - r).abs(), (b.double() - r).abs()
            bound = 2 * err_b + tol["atol"] + tol["rtol"] * r.abs() + _BF16_ULP * r.abs().max()
            if not bool(((err_a <= bound) | (a.isnan() & b.isnan())).all()):
                raise
            COUNTS["bf16_rounding_excused"] = COUNTS.get("bf16_rounding_excused", 0) + 1
            return
        s = sensitivity() if sensitivity is not None else None
        if s is None or s.shape != a.shape:
            raise
        err = (a.double() - b.double()).abs()
        bound = 2 * s.double() + tol["atol"] + tol["rtol"] * b.double().abs()
        if not bool(((err <= bound) | (a.isnan() & b.isnan())).all()):
            raise
        COUNTS["float32_conditioning_excused"] = COUNTS.get("float32_conditioning_excused", 0) + 1


def _sensitivity(fn, P, snap, instances, ref, loss, wrt, eager_grads):
    """How far eager's own float32 results move when every instance's ``x`` moves one ulp, up or
    down (the larger move; state restored around the runs): ``(outputs, gradients)``, per instance
    and output tensor, and per tensor of ``wrt`` (None without autograd); None when a nudged run's
    outputs differ in structure (another branch)."""
    moves = gmoves = None
    n_xs = sum(inst["x"].requires_grad for inst in instances)
    for direction in (math.inf, -math.inf):
        nudged = []
        for inst in instances:
            x = inst["x"].detach()
            y = torch.nextafter(x, torch.full_like(x, direction))
            nudged.append({**inst, "x": y.requires_grad_(inst["x"].requires_grad)})
        out = _eager_again(fn, P, snap, nudged)
        if [_non_tensors(o) for o in out] != [_non_tensors(r) for r in ref]:
            return None
        d = [[(t.detach().double() - r.detach().double()).abs() if t.is_floating_point() else torch.zeros(t.shape)
              for t, r in zip(flat_tensors(o), flat_tensors(rr))] for o, rr in zip(out, ref)]
        moves = d if moves is None else [[torch.maximum(p, q) for p, q in zip(u, v)] for u, v in zip(moves, d)]
        l_n = loss(out)
        if not l_n.requires_grad:
            continue
        # the same parameters; the nudged inputs where ``wrt`` has the instances' own
        wrt_n = wrt[: len(wrt) - n_xs] + [inst["x"] for inst in nudged if inst["x"].requires_grad]
        g_n = torch.autograd.grad(l_n, wrt_n, allow_unused=True)
        gd = [(_dense(a, w).double() - _dense(b, w).double()).abs() for a, b, w in zip(g_n, eager_grads(), wrt)]
        gmoves = gd if gmoves is None else [torch.maximum(p, q) for p, q in zip(gmoves, gd)]
    return moves, gmoves


def _dense(g, like):
    """A gradient, zeros where autograd gave None."""
    return torch.zeros_like(like) if g is None else g


def _eager_again(fn, P, snap, instances):
    """Eager outputs of ``instances`` run again from the module state ``snap`` (the state the
    caller's runs left is put back afterwards)."""
    after = _buffers(P)
    _restore(P, snap)
    MARGIN.tracking = False
    try:
        P.memo.clear()
        return [fn(inst) for inst in instances]
    finally:
        _restore(P, after)


def _float32_reference(fn, P, snap, instances, ref, loss, wrt):
    P.autocast_off = True
    try:
        out32 = _eager_again(fn, P, snap, instances)
    finally:
        P.autocast_off = False
    if [_non_tensors(o) for o in out32] != [_non_tensors(r) for r in ref]:
        return None
    l32 = loss(out32)
    grads = torch.autograd.grad(l32, wrt, allow_unused=True) if l32.requires_grad else [None] * len(wrt)
    grads = [_dense(gr, w) for gr, w in zip(grads, wrt)]
    return [list(flat_tensors(o)) for o in out32], grads


options = st.fixed_dictionaries({
    "scheduler": st.sampled_from(("depth", "agenda")),
    "fibers": st.booleans(),
    "max_pending": st.one_of(st.none(), st.none(), st.integers(1, 40)),
    # every available core on each program in the long profile (C core vs the Python reference,
    # both against eager); one drawn core in the fast one
    "cores": st.just(CORES) if LONG else st.sampled_from(CORES).map(lambda c: [c]),
    "ragged": st.booleans(),   # ragged blocks vs per-length keys, both against eager
    "hoist": st.booleans(),
    "packed_order": st.booleans(),   # recurrences longest instance first vs recording order
    "kernels": st.sampled_from(("default", "onednn")),
    "inference": st.booleans(),  # the whole call under no_grad: fused elementwise kernels (fuse.py)
})


@settings(max_examples=N_MAIN, **_common)
@given(program=programs(), specs=st.lists(instance_specs, min_size=0, max_size=9), opts=options)
def test_random_programs_match_eager(program, specs, opts):
    check_program(program, specs, **opts)


@settings(max_examples=N_SMALL_D, **_common)
@given(program=programs(max_statements=3).filter(lambda p: p[0] == 1),
       specs=st.lists(instance_specs, min_size=1, max_size=4), opts=options)
def test_random_programs_hidden_size_one(program, specs, opts):
    # D == 1: every squeeze/reduction/shape rule meets size-1 dimensions
    check_program(program, specs, **opts)


@settings(max_examples=N_LARGE, **_common)
@given(program=programs(), specs=st.lists(instance_specs, min_size=8, max_size=24), opts=options)
def test_random_programs_large_batches(program, specs, opts):
    # hypothesis favours short lists; here every batch has 8 to 24 instances
    check_program(program, specs, **opts)


def test_fuzz_profile_counts_are_real():
    """The harness itself: a known-good program really is compared (no vacuous passes)."""
    program = (3, (("linear", "module", 0), ("branch", "k_gt", (("unary", "tanh"),), (("tree", "childsum"),))), "tuple")
    specs = [dict(L=2, n=1, k=k, ids=[1, 2], c=0.25, tree=(1, ((2, ()),)), x_grad=True, seed=k) for k in range(4)]
    before = dict(COUNTS)
    f = check_program(program, specs, cores=CORES)
    assert COUNTS["programs"] == before["programs"] + len(CORES)
    assert COUNTS["output_tensors_compared"] == before["output_tensors_compared"] + 8 * len(CORES)
    assert COUNTS["gradients_compared"] > before["gradients_compared"]
    assert f.stats.syncs >= 1 and f.stats.batched_calls < f.stats.ops_recorded


def test_bf16_rounding_excuse_needs_the_float32_result_on_its_side():
    """Bug #31's rule accepts a batched bf16 value only as close to float32 as eager's bf16 one."""
    f32 = torch.tensor([0.786, 1.0])
    eager = torch.tensor([0.964, 1.0])
    _assert_close(torch.tensor([1.078, 1.0]), eager, _GTOL_BF16, "g", lambda: f32)  # #31's numbers
    with pytest.raises(AssertionError):  # as far off, but eager's bf16 value equals float32
        _assert_close(torch.tensor([1.078, 1.0]), f32, _GTOL_BF16, "g", lambda: f32)
    with pytest.raises(AssertionError):  # float32 tolerances never take the excuse
        _assert_close(torch.tensor([1.078, 1.0]), eager, dict(atol=2e-4, rtol=1e-3), "g", lambda: f32)
    with pytest.raises(AssertionError):  # the float32 run took other branches
        _assert_close(torch.tensor([1.078, 1.0]), eager, _GTOL_BF16, "g", lambda: None)
    # #248: a small entry beside large ones moves by up to one bf16 ulp of the largest (a fuzz find)
    f32 = torch.tensor([-0.3434, -16.1518])
    _assert_close(torch.tensor([-0.2262, -16.4695]), torch.tensor([-0.3203, -15.9688]), _GTOL_BF16, "g", lambda: f32)
    with pytest.raises(AssertionError):  # without the large entry, the same miss is not excused
        _assert_close(torch.tensor([-0.2262, -0.3]), torch.tensor([-0.3203, -0.3]), _GTOL_BF16, "g",
                      lambda: torch.tensor([-0.3434, -0.3]))


def test_float32_conditioning_excuse_needs_eager_to_move_as_much():
    """#215's rule accepts a float32 difference only within twice eager's own move under a one-ulp
    nudge of the inputs (plus the tolerance), and never without that measurement."""
    tol = dict(atol=1e-4, rtol=1e-4)
    eager = torch.tensor([0.4306, -0.0762])
    batched = torch.tensor([0.4306, -0.0764])                                          # #215's numbers
    _assert_close(batched, eager, tol, "v", None, lambda: torch.tensor([0.0, 2.02e-4]))
    with pytest.raises(AssertionError):  # eager barely moves: a real difference
        _assert_close(batched, eager, tol, "v", None, lambda: torch.tensor([0.0, 1e-7]))
    with pytest.raises(AssertionError):  # the move is on another element
        _assert_close(batched, eager, tol, "v", None, lambda: torch.tensor([2.02e-4, 0.0]))
    with pytest.raises(AssertionError):  # a nudged run took other branches
        _assert_close(batched, eager, tol, "v", None, lambda: None)
    with pytest.raises(AssertionError):  # no measurement, no excuse
        _assert_close(batched, eager, tol, "v", None)


@pytest.mark.parametrize("inference", [True, False])
def test_the_row_products_statement_reaches_products_from_rows(inference):
    """The statement that feeds rowmm.py: with the harness's 0-byte floor its per-node matrices
    are read in place in inference (and gathered with autograd on), equal to eager either way."""
    from batchcraft.autobatching import rowmm

    program = (4, (("misc", "row_products"), ("unary", "tanh"), ("misc", "row_products")), "h")
    specs = [dict(L=2, n=1, k=k, ids=[1, 2], c=0.25, tree=(1, ((2, ()),)), x_grad=not inference, seed=k)
             for k in range(5)]
    f = check_program(program, specs, cores=CORES, inference=inference)
    if inference and rowmm.sgemm_batch():
        assert f.stats.rows_in_place > 0
    if not inference:
        assert f.stats.rows_in_place == 0


@pytest.mark.parametrize("inference", [True, False])
def test_the_mv_compose_statement_joins_sums_and_leaves_dead_rows(inference):
    """The MV-RNN-shaped statement: its matrix sums run as one pass (rowmm.sum_of_products) and,
    in inference on the C core, the dropped last matrix of even-k instances is not computed
    (execute.DEAD_ROWS); both cores equal eager either way."""
    from batchcraft.autobatching import rowmm

    program = (4, (("misc", "mv_compose"), ("unary", "tanh")), "h")
    specs = [dict(L=2, n=k % 2, k=k, ids=[1, 2, 3][:1 + k % 3], c=0.25, tree=(1, ((2, ()),)), x_grad=not inference,
                  seed=k) for k in range(6)]
    check_program(program, specs, cores=CORES, inference=inference)
    if "c" in CORES:
        f = check_program(program, specs, cores=["c"], inference=inference)
        if inference and (rowmm.sgemm_batch() or rowmm.shared_kernel()):
            assert f.stats.rows_dead > 0
        else:
            assert f.stats.rows_dead == 0
