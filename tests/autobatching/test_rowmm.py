"""Batched products read per-node matrices in place (rowmm.py, gather.RowRefs).

Each product computed from rows' addresses (a pointer-array GEMM) must equal ``torch.matmul``
of the gathered rows; every case the pointer path does not handle (autograd, strides, dtypes,
small rows, no extension) must take the gather and still be right. End to end, MV-RNN-style
compositions (per-node matrices from several buffers, read by a vector product and by an
accumulated matrix product) match eager with the rows read in place.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchcraft import autobatch, static_block
from batchcraft.autobatching import gather, rowmm

from equivalence import CORES, assert_matches_eager
from mvblocks import compose_words, mv_blocks

needs_gemm = pytest.mark.skipif(not rowmm.sgemm_batch(), reason="no pointer-array GEMM in this build (or no extension)")


def _refs(buffers, plan):
    r = gather.row_refs(buffers, plan)
    assert r is not None
    return r


def _pieces(rng, n, shape, n_buffers):
    """``n`` rows of ``shape`` spread over ``n_buffers`` buffers: (buffers, multi plan, gathered)."""
    bufs = [torch.randn(n + 3, *shape, generator=rng) for _ in range(n_buffers)]
    owner = torch.randint(0, n_buffers, (n,), generator=rng).tolist()
    pieces, order = [], []
    for b in range(n_buffers):
        rows = [i + 1 for i in range(n) if owner[i] == b]
        if rows:
            pieces.append((b, rows))
            order += [(b, r) for r in rows]
    perm = torch.randperm(n, generator=rng).tolist()  # row i of the group = concatenation row perm[i]
    gathered = torch.stack([bufs[order[p][0]][order[p][1]] for p in perm])
    return bufs, ("multi", pieces, perm), gathered


@needs_gemm
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # (one patch for all)
@given(n=st.integers(1, 9), m=st.integers(1, 6), k=st.integers(1, 7), n_out=st.integers(1, 6),
       buffers=st.integers(1, 3), transposed=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_products_from_row_addresses_equal_matmul_of_the_gathered_rows(n, m, k, n_out, buffers, transposed, seed,
                                                                       monkeypatch):
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    rng = torch.Generator().manual_seed(seed)
    bufs, plan, g = _pieces(rng, n, (m, k), buffers)
    big = torch.randn(n_out + 2, 2 * k + 1, generator=rng)
    w = big[:n_out, 1:k + 1].t() if transposed else torch.randn(k, n_out, generator=rng)  # strided weights too
    with torch.no_grad():
        torch.testing.assert_close(rowmm.matmul(_refs(bufs, plan), w), torch.matmul(g, w), rtol=1e-5, atol=1e-5)
        vec = torch.randn(n, 1, m, generator=rng)
        bufs2, plan2, g2 = _pieces(rng, n, (m, k), buffers)
        torch.testing.assert_close(rowmm.matmul(vec, _refs(bufs2, plan2)), torch.matmul(vec, g2), rtol=1e-5, atol=1e-5)
        acc = torch.randn(n, m, n_out, generator=rng)
        want = acc + torch.matmul(g, w)
        got = rowmm.matmul_accumulate(acc.clone(), _refs(bufs, plan), w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cases_the_pointer_path_does_not_take_gather_and_match(monkeypatch):
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    rng = torch.Generator().manual_seed(0)
    bufs, plan, g = _pieces(rng, 5, (3, 4), 2)
    r = gather.row_refs(bufs, plan)
    w = torch.randn(4, 2, generator=rng)
    cases = [
        (r, torch.randn(8, 2, generator=rng)[::2]),   # neither stride of the weight is 1
        (r, w.double()),                              # dtype
        (torch.randn(5, 1, 3, generator=rng).double(), _refs(bufs, ("index", 0, [1, 2, 3]))),
        (r, torch.randn(5, 4, 2, generator=rng)),     # per-node right operand
    ]
    for a, b in cases:
        try:
            want = torch.matmul(gather.materialize(a), gather.materialize(b))
        except RuntimeError as exc:
            with pytest.raises(RuntimeError, match=str(exc).split(":")[0][:20]):
                rowmm.matmul(a, b)
            continue
        torch.testing.assert_close(rowmm.matmul(a, b), want)
    wg = w.clone().requires_grad_()
    out = rowmm.matmul(r, wg)  # grad mode on: torch's matmul of the gathered rows, with history
    assert out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(wg.grad, g.sum((0, 1))[:, None].expand(4, 2))


def test_row_refs_declines_what_its_rows_cannot_stand_for(monkeypatch):
    bufs = [torch.randn(6, 40, 40)]
    assert gather.row_refs(bufs, ("view", 0, 0, 6)) is None  # no copy to save
    assert gather.row_refs([torch.randn(6, 4, 4)], ("index", 0, [1, 2])) is None  # small rows: gathered
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    assert gather.row_refs(bufs, ("index", 0, [1, 6])) is None  # out of its buffer
    assert gather.row_refs([torch.randn(6, 3, 3).requires_grad_()], ("index", 0, [1])) is None
    assert gather.row_refs([torch.randn(6, 3, 3, dtype=torch.float64)], ("index", 0, [1])) is None
    assert gather.row_refs([torch.randn(3, 6, 3).transpose(0, 1)], ("index", 0, [1])) is None  # rows not contiguous
    assert gather.row_refs([torch.randn(6, 3, 3, dtype=torch.cfloat).conj()], ("index", 0, [1])) is None
    assert gather.row_refs([torch.randn(6, 3, 3)._neg_view()], ("index", 0, [1])) is None  # memory is not the values
    r = gather.row_refs(bufs, ("index", 0, [4, 0, 4]))
    torch.testing.assert_close(gather.materialize(r), bufs[0][[4, 0, 4]])


def _mv_model(h: int):
    leaf, compose, params = mv_blocks(h)

    def fn(words):
        return compose_words(leaf, compose, words)

    return fn, params


@pytest.mark.parametrize("h", [32, 8])
def test_compositions_read_their_matrices_in_place_and_match_eager(h, monkeypatch):
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 1024)  # h 32: 4 KiB rows, in place; h 8: gathered
    fn, params = _mv_model(h)
    g = torch.Generator().manual_seed(1)
    sents = [torch.randint(0, 30, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (12,), generator=g)]
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [])
        f(sents)
    if rowmm.sgemm_batch() and h == 32:
        assert f.stats.rows_in_place > 0
    elif h == 8:
        assert f.stats.rows_in_place == 0
    assert_matches_eager(fn, sents, params)  # training: the gathers and torch's products, with gradients


def test_without_the_extension_the_products_gather(monkeypatch):
    monkeypatch.setattr(rowmm, "_ADDRESS", [0])  # as a build without the extension or without MKL
    monkeypatch.setattr(rowmm, "_SHARED", [False])  # and without AVX-512
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 1024)
    fn, _ = _mv_model(32)
    sents = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [])
        f(sents)
    assert f.stats.rows_in_place == 0


def test_empty_products_are_torchs(monkeypatch):
    # hostile helper, stop 40: an (0, K) or (M, 0) product sent a zero size to the GEMM, which
    # refused it, and the whole group ran one instance at a time
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    rng = torch.Generator().manual_seed(2)
    bufs, plan, g = _pieces(rng, 4, (3, 5), 2)
    with torch.no_grad():
        for a, b in ((_refs(bufs, plan), torch.randn(5, 0)), (torch.randn(4, 0, 3), _refs(bufs, plan))):
            want = torch.matmul(gather.materialize(a), gather.materialize(b))
            got = rowmm.matmul(a, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)


def _gemm_here() -> bool:
    return bool(rowmm._fused and hasattr(rowmm._fused, "gemm_batch") and rowmm._find())


def _shared_here() -> bool:
    return bool(rowmm._fused and rowmm._fused.vector_maths == "avx512f")


@pytest.mark.parametrize("check", [("sgemm_batch", "_ADDRESS", _gemm_here), ("shared_kernel", "_SHARED", _shared_here)],
                         ids=["pointer_gemm", "shared_kernel"])
@pytest.mark.parametrize("state", ["float64_default", "autocast", "vmap", "jvp"])
def test_the_kernel_checks_do_not_depend_on_the_callers_state(check, state, monkeypatch):
    # hostile helper, stop 40: the one-time check of the pointer GEMM ran on the default dtype
    # (float64 made it fail) or under autocast (bf16 results): the feature was off for good.
    # The AVX-512 kernel's check (stop 54) is run the same way.
    name, memo, here = check
    if not here():
        pytest.skip(f"no {name} in this build")
    found = getattr(rowmm, name)
    monkeypatch.setattr(rowmm, memo, [])
    if state == "float64_default":
        torch.set_default_dtype(torch.float64)
        try:
            assert found()
        finally:
            torch.set_default_dtype(torch.float32)
    elif state == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert found()
    elif state == "vmap":  # reliability #209: the check's own random draw inside the caller's vmap
        torch.func.vmap(lambda x: x * bool(found()))(torch.ones(2, 3))
        assert getattr(rowmm, memo)[0]
    else:
        torch.func.jvp(lambda x: x * bool(found()), (torch.ones(3),), (torch.ones(3),))
        assert getattr(rowmm, memo)[0]


@needs_gemm
def test_rows_in_place_counts_each_calls_own_rows_under_threads(monkeypatch):
    # hostile helper, stop 40: one process-wide count of copied rows was subtracted from the
    # stats of whichever call's group ran meanwhile (another thread's: counts went negative)
    import threading

    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 1024)
    fn, _ = _mv_model(32)
    sents = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    f = autobatch(fn)
    with torch.no_grad():
        f(sents)
        f(sents)
        alone = f.stats.rows_in_place
    assert alone > 0
    big = torch.randn(64, 64)
    strided = big[::2, ::2]  # neither stride 1: its products copy the rows
    other = static_block(lambda A: A @ strided)
    g = autobatch(lambda k: other(torch.full((32, 32), float(k))))
    stop = threading.Event()

    def churn():
        with torch.no_grad():
            while not stop.is_set():
                g(list(range(6)))

    t = threading.Thread(target=churn)
    t.start()
    try:
        with torch.no_grad():
            counts = []
            for _ in range(10):
                f(sents)
                counts.append(f.stats.rows_in_place)
    finally:
        stop.set()
        t.join()
    assert counts == [alone] * 10


@needs_gemm
@pytest.mark.parametrize("how", ["dual_level", "jvp"])
def test_forward_mode_tangents_through_products_of_per_instance_matrices(how):
    # reliability #209 (hostile helper, stop 41; present before): under no_grad the products read
    # the per-instance matrices in place (a raw GEMM) inside a dual level: every tangent came back
    # None; MV-RNN's gathers and table lookups under forward AD raised or dropped tangents too
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, jvp
    from torch.nn.utils.stateless import _reparametrize_module

    from batchcraft.data import load_sentences
    from batchcraft.models import mvrnn

    task = mvrnn.build_task(load_sentences(limit=12), 32)  # (32 x 32 float32 matrices: 4 KiB rows)
    model, data = task.model, task.instances
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    tang = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in params.items()}
    f = autobatch(model)
    with torch.no_grad():
        plain = f(data)
        assert f.stats.rows_in_place > 0  # outside forward AD the products read the rows in place
        for o, s in zip(plain, data):
            torch.testing.assert_close(o, model(s), atol=1e-5, rtol=1e-5)
        if how == "dual_level":
            with fwAD.dual_level():
                duals = {k: fwAD.make_dual(v, tang[k]) for k, v in params.items()}
                with _reparametrize_module(model, duals):
                    got = [fwAD.unpack_dual(o).tangent for o in f(data)]
                    ref = [fwAD.unpack_dual(model(s)).tangent for s in data]
            assert all(t is not None for t in got)
            got, ref = torch.cat([t.reshape(-1) for t in got]), torch.cat([t.reshape(-1) for t in ref])
        else:
            def batched(p):
                with _reparametrize_module(model, p):
                    return torch.cat([o.reshape(-1) for o in f(data)])

            def eager(p):
                return torch.cat([functional_call(model, p, (s,)).reshape(-1) for s in data])

            got, ref = jvp(batched, (params,), (tang,))[1], jvp(eager, (params,), (tang,))[1]
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(rowmm._fused is None, reason="no extension")
@settings(max_examples=40, deadline=None)
@given(count=st.integers(0, 7), k=st.integers(1, 40), n=st.integers(1, 40), pad=st.integers(0, 3),
       x_gap=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_gemv_rows_equals_a_vector_times_each_matrix(count, k, n, pad, x_gap, seed):
    rng = torch.Generator().manual_seed(seed)
    mats = torch.randn(count + 2, k, n + pad, generator=rng)  # rows n + pad floats apart
    pick = torch.randint(0, count + 2, (count,), generator=rng).tolist()
    addrs = torch.tensor([mats[i].data_ptr() for i in pick], dtype=torch.int64)
    x = torch.randn(count, k + x_gap, generator=rng)[:, :k]  # rows k + x_gap floats apart
    out = torch.full((count, n), float("nan"))
    rowmm._fused.gemv_rows(count, k, n, x.data_ptr(), x.stride(0) * 4, addrs.data_ptr(), n + pad,
                           out.data_ptr(), n * 4)
    want = torch.stack([x[j] @ mats[i][:, :n] for j, i in enumerate(pick)]) if count else out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(rowmm._fused is None, reason="no extension")
def test_gemv_rows_refuses_bad_sizes_and_null_addresses():
    x, out = torch.randn(2, 3), torch.empty(2, 4)
    m = torch.randn(3, 4)
    good = torch.tensor([m.data_ptr(), m.data_ptr()], dtype=torch.int64)
    with pytest.raises(ValueError, match="bad sizes"):
        rowmm._fused.gemv_rows(2, 3, 4, x.data_ptr(), 12, good.data_ptr(), 3, out.data_ptr(), 16)  # ldb < n
    with pytest.raises(ValueError, match="null matrix"):
        bad = torch.tensor([m.data_ptr(), 0], dtype=torch.int64)
        rowmm._fused.gemv_rows(2, 3, 4, x.data_ptr(), 12, bad.data_ptr(), 4, out.data_ptr(), 16)


@needs_gemm
def test_a_vector_times_per_node_matrices_reads_them_with_the_vector_kernel(monkeypatch):
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    calls = []
    real = rowmm._fused.gemv_rows

    class Spy:
        gemm_batch = staticmethod(rowmm._fused.gemm_batch)

        @staticmethod
        def gemv_rows(*a):
            calls.append(a[:3])
            return real(*a)

    monkeypatch.setattr(rowmm, "_fused", Spy)
    rng = torch.Generator().manual_seed(0)
    bufs, plan, g = _pieces(rng, 5, (6, 7), 2)
    vec = torch.randn(5, 1, 6, generator=rng)
    with torch.no_grad():
        torch.testing.assert_close(rowmm.matmul(vec, _refs(bufs, plan)), torch.matmul(vec, g), rtol=1e-5, atol=1e-5)
    assert calls == [(5, 6, 7)]


needs_shared = pytest.mark.skipif(not rowmm.shared_kernel(), reason="no AVX-512 shared-weight kernel here")


@needs_shared
@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 6), m=st.integers(1, 20), k=st.integers(1, 40), n=st.integers(1, 70),
       pad=st.integers(0, 3), transposed=st.booleans(), beta=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2 ** 16))
def test_gemm_shared_equals_each_rows_times_the_shared_matrix(count, m, k, n, pad, transposed, beta, seed):
    # rows not a multiple of the 8-row tile, columns not of the 32-column panel, padded rows
    rng = torch.Generator().manual_seed(seed)
    mats = torch.randn(count + 2, m, k + pad, generator=rng)  # A_i rows k + pad floats apart
    pick = torch.randint(0, count + 2, (count,), generator=rng).tolist()
    addrs = torch.tensor([mats[i].data_ptr() for i in pick], dtype=torch.int64)
    if transposed:
        w = torch.randn(n, k + pad, generator=rng)[:, :k].t()  # (k, n) with unit row stride
        ldw = k + pad
    else:
        w = torch.randn(k, n + pad, generator=rng)[:, :n]
        ldw = n + pad
    c = torch.randn(count, m, n + pad, generator=rng)  # C_i rows n + pad floats apart
    want = torch.stack([mats[i][:, :k] @ w for i in pick]) if count else c[..., :n]
    if beta:
        want = want + c[..., :n]
    keep = c[..., n:].clone()
    assert rowmm._fused.gemm_shared(count, m, k, n, addrs.data_ptr(), k + pad, w.data_ptr(), transposed, ldw, beta,
                                    c.data_ptr(), m * (n + pad) * 4, n + pad)
    torch.testing.assert_close(c[..., :n], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(c[..., n:], keep)  # the padding between rows is not written


@needs_shared
@pytest.mark.parametrize("count,m", [(1, 64), (2, 9), (40, 16)])
def test_gemm_shared_splits_units_over_threads_and_each_thread_count_agrees(count, m):
    # one node's row blocks are shared by the threads too (a deep level of few nodes)
    rng = torch.Generator().manual_seed(count)
    mats = torch.randn(count, m, 96, generator=rng)
    addrs = torch.tensor([mats[i].data_ptr() for i in range(count)], dtype=torch.int64)
    w = torch.randn(96, 80, generator=rng)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c = torch.full((count, m, 80), float("nan"))
            assert rowmm._fused.gemm_shared(count, m, 96, 80, addrs.data_ptr(), 96, w.data_ptr(), False, 80, 0.0,
                                            c.data_ptr(), m * 80 * 4, 80)
            outs.append(c)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # each element's sum runs in the same order on any thread
    torch.testing.assert_close(outs[0], torch.matmul(mats, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(rowmm._fused is None or not hasattr(rowmm._fused, "gemm_shared"), reason="no extension")
def test_gemm_shared_refuses_bad_sizes_and_declines_other_betas():  # (both terms)
    a = torch.randn(2, 3, 4)
    w = torch.randn(4, 5)
    c = torch.empty(2, 3, 5)
    good = torch.tensor([a[0].data_ptr(), a[1].data_ptr()], dtype=torch.int64)
    args = (2, 3, 4, 5, good.data_ptr(), 4, w.data_ptr(), False, 5)
    with pytest.raises(ValueError, match="bad sizes"):
        rowmm._fused.gemm_shared(2, 3, 4, 5, good.data_ptr(), 3, w.data_ptr(), False, 5, 0.0, c.data_ptr(), 60, 5)
    with pytest.raises(ValueError, match="bad sizes"):
        rowmm._fused.gemm_shared(2, 3, 4, 5, good.data_ptr(), 4, w.data_ptr(), False, 4, 0.0, c.data_ptr(), 60, 5)
    with pytest.raises(ValueError, match="null matrix"):
        bad = torch.tensor([a[0].data_ptr(), 0], dtype=torch.int64)
        rowmm._fused.gemm_shared(2, 3, 4, 5, bad.data_ptr(), 4, w.data_ptr(), False, 5, 0.0, c.data_ptr(), 60, 5)
    c.fill_(7.0)
    assert rowmm._fused.gemm_shared(*args, 0.5, c.data_ptr(), 60, 5) is False  # (MKL's batch serves beta 0.5)
    assert torch.all(c == 7.0)
    head = (*args, 0.0, c.data_ptr(), 60, 5)  # a second term (the joined sum) checked as the first
    with pytest.raises(ValueError, match="bad sizes"):
        rowmm._fused.gemm_shared(*head, 0, good.data_ptr(), 4, w.data_ptr(), False, 5)  # k2 0
    with pytest.raises(ValueError, match="bad sizes"):
        rowmm._fused.gemm_shared(*head, 4, good.data_ptr(), 4, w.data_ptr(), False, 4)  # ldw2 < n
    with pytest.raises(ValueError, match="null matrix"):
        rowmm._fused.gemm_shared(*head, 4, bad.data_ptr(), 4, w.data_ptr(), False, 5)


@pytest.mark.parametrize("shared", [True, False])
def test_row_products_take_the_shared_kernel_or_mkls_batch_and_agree(shared, monkeypatch):
    if shared and not rowmm.shared_kernel():
        pytest.skip("no AVX-512 shared-weight kernel here")
    if not shared and not rowmm.sgemm_batch():
        pytest.skip("no pointer-array GEMM in this build")
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    monkeypatch.setattr(rowmm, "_SHARED", [shared])
    calls = []
    real = rowmm._fused

    class Spy:
        @staticmethod
        def gemm_shared(*a):
            calls.append("shared")
            return real.gemm_shared(*a)

        @staticmethod
        def gemm_batch(*a):
            calls.append("mkl")
            return real.gemm_batch(*a)

    monkeypatch.setattr(rowmm, "_fused", Spy)
    rng = torch.Generator().manual_seed(3)
    bufs, plan, g = _pieces(rng, 6, (10, 12), 3)
    w = torch.randn(9, 12, generator=rng).t()  # a transposed shared weight, as ``W[:, :h].t()``
    acc = torch.randn(6, 10, 9, generator=rng)
    with torch.no_grad():
        torch.testing.assert_close(rowmm.matmul(_refs(bufs, plan), w), torch.matmul(g, w), rtol=1e-5, atol=1e-5)
        got = rowmm.matmul_accumulate(acc.clone(), _refs(bufs, plan), w)
        torch.testing.assert_close(got, acc + torch.matmul(g, w), rtol=1e-5, atol=1e-5)
    assert calls == (["shared", "shared"] if shared else ["mkl", "mkl"])


def test_the_shared_kernel_is_off_under_the_portable_switch():
    # BATCHCRAFT_FUSED_PORTABLE (the fused kernels' portable loops) turns the AVX-512 GEMM off too:
    # the products then take MKL's batch, or the gathers, and stay right
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from batchcraft.autobatching import rowmm, gather\n"
        "gather.ROW_REFS_MIN_BYTES = 0\n"
        "assert not rowmm.shared_kernel()\n"
        "bufs = [torch.randn(5, 4, 6)]\n"
        "r = gather.row_refs(bufs, ('index', 0, [0, 2, 4]))\n"
        "w = torch.randn(6, 3)\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(rowmm.matmul(r, w), torch.matmul(bufs[0][[0, 2, 4]], w))\n"
        "print('ok')\n"
    )
    import os
    env = dict(os.environ, BATCHCRAFT_FUSED_PORTABLE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"



@needs_shared
@settings(max_examples=50, deadline=None)
@given(count=st.integers(0, 5), m=st.integers(1, 18), k1=st.integers(1, 30), k2=st.integers(1, 30),
       n=st.integers(1, 70), t1=st.booleans(), t2=st.booleans(), beta=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2 ** 16))
def test_gemm_shared_sums_two_products_in_one_pass(count, m, k1, k2, n, t1, t2, beta, seed):
    rng = torch.Generator().manual_seed(seed)

    def term(k, transposed):
        mats = torch.randn(count + 1, m, k, generator=rng)
        pick = torch.randint(0, count + 1, (count,), generator=rng).tolist()
        addrs = torch.tensor([mats[i].data_ptr() for i in pick], dtype=torch.int64)
        w = torch.randn(n, k, generator=rng).t() if transposed else torch.randn(k, n, generator=rng)
        want = torch.stack([mats[i] @ w for i in pick]) if count else torch.zeros(0, m, n)
        return mats, addrs, w, (n if not transposed else k), want  # (mats: the rows stay alive)

    m1, a1, w1, ld1, p1 = term(k1, t1)
    m2, a2, w2, ld2, p2 = term(k2, t2)
    c = torch.randn(count, m, n, generator=rng)
    want = p1 + p2 + (c if beta else 0)
    assert rowmm._fused.gemm_shared(count, m, k1, n, a1.data_ptr(), k1, w1.data_ptr(), t1, ld1, beta, c.data_ptr(),
                                    m * n * 4, n, k2, a2.data_ptr(), k2, w2.data_ptr(), t2, ld2)
    torch.testing.assert_close(c, want, rtol=1e-5, atol=1e-4)



@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize("live", [None, 4, 0])
def test_a_sum_of_row_products_is_one_pass_or_two_calls_and_agrees(join, live, monkeypatch):
    if not (rowmm.sgemm_batch() or rowmm.shared_kernel()):
        pytest.skip("no row products in this build")
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    monkeypatch.setattr(rowmm, "JOIN_SUMS", join)
    calls = []
    real = rowmm._fused

    class Spy:
        @staticmethod
        def gemm_shared(*a):
            calls.append(len(a))
            return real.gemm_shared(*a)

        gemm_batch = staticmethod(real.gemm_batch)

    monkeypatch.setattr(rowmm, "_fused", Spy)
    rng = torch.Generator().manual_seed(5)
    b1, p1, g1 = _pieces(rng, 6, (10, 12), 2)
    b2, p2, g2 = _pieces(rng, 6, (10, 7), 3)
    w1 = torch.randn(9, 12, generator=rng).t()
    w2 = torch.randn(7, 9, generator=rng)
    want = torch.matmul(g1, w1) + torch.matmul(g2, w2)
    with torch.no_grad():
        got = rowmm.sum_of_products(_refs(b1, p1), w1, _refs(b2, p2), w2, live)
    cut = 6 if live is None else live
    torch.testing.assert_close(got[:cut], want[:cut], rtol=1e-5, atol=1e-5)
    assert torch.isnan(got[cut:]).all()
    if rowmm.shared_kernel() and cut:
        assert calls == ([19] if join else [13, 13])  # one call with both terms, or a product and a sum


@needs_shared
def test_a_joined_sum_rounds_as_the_two_calls_even_where_the_products_cancel(monkeypatch):
    # hostile helper, stop 54: one FMA chain over both products differed from eager's
    # round(A W1) + round(B W2) by 1.1e-4 where W2 ~ -W1; each product is now rounded on its own
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    rng = torch.Generator().manual_seed(7)
    b1, p1, g1 = _pieces(rng, 9, (32, 32), 2)
    b2, p2, g2 = _pieces(rng, 9, (32, 32), 2)
    w1 = torch.randn(32, 32, generator=rng)
    w2 = -w1 + 1e-3 * torch.randn(32, 32, generator=rng)
    with torch.no_grad():
        got = {}
        for join in (True, False):
            monkeypatch.setattr(rowmm, "JOIN_SUMS", join)
            got[join] = rowmm.sum_of_products(_refs(b1, p1), w1, _refs(b2, p2), w2)
    assert torch.equal(got[True], got[False])
    assert torch.equal(got[True], torch.matmul(g1, w1) + torch.matmul(g2, w2))  # eager's bits here


@needs_shared
@settings(max_examples=50, deadline=None)
@given(count=st.integers(0, 6), m=st.integers(1, 20), k=st.integers(1, 40), n=st.integers(1, 70),
       pad=st.integers(0, 3), beta=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2 ** 16))
def test_gemm_left_shared_equals_the_shared_matrix_times_each_node(count, m, k, n, pad, beta, seed):
    # W A_i with W shared on the left (MV-RNN as Socher wrote it): each node's matrix read
    # unpacked, through masks past column n (pad: rows n + pad floats apart, never written)
    rng = torch.Generator().manual_seed(seed)
    mats = torch.randn(count + 2, k, n + pad, generator=rng)
    pick = torch.randint(0, count + 2, (count,), generator=rng).tolist()
    addrs = torch.tensor([mats[i].data_ptr() for i in pick], dtype=torch.int64)
    w = torch.randn(m, k + pad, generator=rng)[:, :k]  # rows k + pad floats apart
    c = torch.randn(count, m, n + pad, generator=rng)
    want = torch.stack([w @ mats[i][:, :n] for i in pick]) if count else c[..., :n]
    if beta:
        want = want + c[..., :n]
    keep = c[..., n:].clone()
    assert rowmm._fused.gemm_left_shared(count, m, k, n, w.data_ptr(), k + pad, addrs.data_ptr(), n + pad, beta,
                                         c.data_ptr(), m * (n + pad) * 4, n + pad)
    torch.testing.assert_close(c[..., :n], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(c[..., n:], keep)


@pytest.mark.skipif(rowmm._fused is None or not hasattr(rowmm._fused, "gemm_left_shared"), reason="no extension")
def test_gemm_left_shared_refuses_bad_sizes_and_declines_other_betas():
    b = torch.randn(2, 4, 5)
    w = torch.randn(3, 4)
    c = torch.full((2, 3, 5), 7.0)
    good = torch.tensor([b[0].data_ptr(), b[1].data_ptr()], dtype=torch.int64)
    with pytest.raises(ValueError, match="bad sizes"):
        rowmm._fused.gemm_left_shared(2, 3, 4, 5, w.data_ptr(), 3, good.data_ptr(), 5, 0.0, c.data_ptr(), 60, 5)
    with pytest.raises(ValueError, match="null matrix"):
        bad = torch.tensor([b[0].data_ptr(), 0], dtype=torch.int64)
        rowmm._fused.gemm_left_shared(2, 3, 4, 5, w.data_ptr(), 4, bad.data_ptr(), 5, 0.0, c.data_ptr(), 60, 5)
    assert rowmm._fused.gemm_left_shared(2, 3, 4, 5, w.data_ptr(), 4, good.data_ptr(), 5, 0.5, c.data_ptr(), 60,
                                         5) is False
    assert torch.all(c == 7.0)


@pytest.mark.parametrize("layout", ["plain", "transposed"])
def test_a_shared_matrix_times_per_node_rows_is_read_in_place(layout, monkeypatch):
    if not rowmm.shared_kernel():
        pytest.skip("no AVX-512 shared-weight kernel here")
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 0)
    calls = []
    real = rowmm._fused

    class Spy:
        @staticmethod
        def gemm_left_shared(*a):
            calls.append(a[:4])
            return real.gemm_left_shared(*a)

    monkeypatch.setattr(rowmm, "_fused", Spy)
    rng = torch.Generator().manual_seed(9)
    bufs, plan, g = _pieces(rng, 7, (12, 10), 3)
    w = torch.randn(5, 12, generator=rng) if layout == "plain" else torch.randn(12, 5, generator=rng).t()
    with torch.no_grad():
        torch.testing.assert_close(rowmm.matmul(w, _refs(bufs, plan)), torch.matmul(w, g), rtol=1e-5, atol=1e-5)
    assert calls == [(7, 5, 12, 10)]


@pytest.mark.parametrize("core", CORES)
def test_socher_form_sums_read_their_matrices_in_place_and_match_eager(core, monkeypatch):
    # a new user's trial (stop 54): P = W1 A + W2 B, the shared matrices on the left, without a
    # static block: the per-node matrices were gathered (0.53x of the loop at hidden 128, 1 thread)
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 1024)
    torch.manual_seed(4)
    h = 16
    table = torch.nn.Embedding(30, h * h)
    w1, w2 = torch.randn(h, h) / 4, torch.randn(h, h) / 4

    def fn(ids):
        M = table(torch.tensor(ids[0])).view(h, h)
        for w in ids[1:]:
            B = table(torch.tensor(w)).view(h, h)
            M = torch.tanh(w1 @ M + w2 @ B)
        return M

    g = torch.Generator().manual_seed(2)
    sents = [torch.randint(0, 30, (int(k),), generator=g).tolist() for k in torch.randint(2, 7, (9,), generator=g)]
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [], core=core)
        f(sents)
    if rowmm.shared_kernel():
        assert f.stats.rows_in_place > 0


@pytest.mark.parametrize("core", CORES)
def test_a_shared_matrix_times_a_batch_of_dense_matrices_takes_the_kernel(core, monkeypatch):
    # Socher's form with a concatenation, W_M @ cat([A, B]): the product of the shared matrix and
    # each node's (dense, gathered) matrix; torch broadcasts W_M over the batch (48 GFLOP/s on one
    # core). In inference the kernel computes it; with autograd, torch's (same values, gradients)
    torch.manual_seed(6)
    h = 8
    wm = torch.randn(h, 2 * h, requires_grad=True)
    blk = static_block(lambda A, B: torch.tanh(wm @ torch.cat([A, B], 0)))
    insts = [(torch.randn(h, h), torch.randn(h, h)) for _ in range(6)]
    calls = []
    real = rowmm._fused

    class Spy:
        gemm_shared = staticmethod(real.gemm_shared) if real is not None else None
        gemm_batch = staticmethod(real.gemm_batch) if real is not None else None
        gemv_rows = staticmethod(real.gemv_rows) if real is not None else None

        @staticmethod
        def gemm_left_shared(*a):
            calls.append(a[:4])
            return real.gemm_left_shared(*a)

    if real is not None:
        monkeypatch.setattr(rowmm, "_fused", Spy)
    with torch.no_grad():
        for _ in range(2):
            f = assert_matches_eager(lambda p: blk(*p), insts, [], core=core)
    assert f.stats.fallbacks == 0
    if rowmm.shared_kernel():
        assert calls and calls[-1] == (6, h, 2 * h, h)
    calls.clear()
    assert_matches_eager(lambda p: blk(*p), insts, [wm], core=core)  # autograd: torch's product
    assert not calls
