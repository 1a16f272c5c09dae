"""Batched products that read per-node matrices where they lie (a pointer-array GEMM).

A group's per-node operand is usually gathered first: its rows, spread over the buffers of
earlier groups, are copied into one ``(n, ...)`` tensor that ``torch.matmul`` then reads. For
large rows this copy costs as much as a third of the product (MV-RNN at hidden 128 composes
64 KiB matrices ``A^T``, ``B^T``: 12-14 ms of gathers a batch of 64 sentences). DyNet keeps
every node's value in one memory pool and batches by pointers; cuBLAS and MKL offer the same
for GEMMs: ``cblas_sgemm_batch`` takes an array of operand addresses (Intel MKL Developer
Reference, "cblas_?gemm_batch"). torch's CPU library carries MKL and exports that function, so
the lowered programs call it through ``_fused.gemm_batch`` on the rows' addresses
(:class:`~batchcraft.autobatching.gather.RowRefs`), and the gather is never made.

Where it applies (:func:`matmul`, :func:`matmul_accumulate`): inference (no autograd),
float32 on the CPU, no autocast, a per-node operand given as ``RowRefs`` of ``(M, K)`` or
``(K, N)`` rows, the other operand a shared 2-D matrix with one unit stride or a per-node
``(n, M, K)`` tensor with unit last stride. Anything else materializes the rows (the gather
it saved) and runs ``torch.matmul`` as written. Values: each node's product is one GEMM of the
same shapes torch folds it to; float32 rounding can differ from torch's single GEMM in the
order of the K-sums (within float32 tolerance; on the shapes measured here it is bit-identical).

The function is found once per process (:func:`sgemm_batch`) and checked against
``torch.matmul`` on a small case before first use; a torch without it (no MKL: ARM, OpenBLAS
builds) keeps the gathers.

Where the CPU has AVX-512F, rows times a *shared* matrix run in ``_fused.gemm_shared`` instead
(:func:`shared_kernel`): MKL takes its AVX2 path on AMD CPUs (147-148 GFLOP/s on 2 cores at
MV-RNN's 128 x 128 x 128); the kernel packs the weight once per call into 32-column panels and
runs an 8 x 32 register tile, the next rows prefetched (198-201 GFLOP/s; the blocking of Goto and
van de Geijn, "Anatomy of high-performance matrix multiplication", ACM TOMS 34(3), 2008). A sum
of two such products (:func:`sum_of_products`) is one pass that writes each output tile once.
``live``: rows of an output nothing reads are not computed (execute.py's dead rows).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from batchcraft.autobatching.gather import RowRefs, materialize
from batchcraft.autobatching.threadstate import outside_transforms, tangents_possible

try:  # optional extension (the pointer arrays are built in C)
    from batchcraft.autobatching import _fused
except ImportError:  # pragma: no cover - exercised by the CC=/bin/false install
    _fused = None

_T = torch.Tensor
_F32 = torch.float32
_lock = threading.Lock()
_ADDRESS: list = []  # [address or 0], filled once
_SHARED: list = []  # [gemm_shared runs here and is right], filled once
_SKIPPED = threading.local()  # .n: rows this thread's products left uncomputed (``live``)


def skipped_rows() -> int:
    """Rows of outputs nothing reads that this thread's products have left uncomputed (NaN) so far
    (``live``): the executor's ``stats.rows_dead`` counts the difference across a group's run,
    so a product that computed every row after all (a fallback) is not counted."""
    return getattr(_SKIPPED, "n", 0)


def _skipped(rows: int) -> None:
    _SKIPPED.n = getattr(_SKIPPED, "n", 0) + rows


def _find() -> int:
    """The address of ``cblas_sgemm_batch`` in the process's torch libraries, or 0."""
    names = [None]  # the process's global symbols first
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names += [os.path.join(lib_dir, n) for n in ("libtorch_cpu.so", "libtorch_cpu.dylib")]
    for name in names:
        if name is not None and not os.path.exists(name):
            continue
        try:
            fn = getattr(ctypes.CDLL(name), "cblas_sgemm_batch")
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    return 0


def _works(address: int) -> bool:
    """Does ``address`` compute ``torch.matmul``'s products (two nodes, a transposed operand)?"""
    # (explicit dtypes, no autocast: the caller's default dtype or autocast must not decide it)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(2, 3, 5, generator=g, dtype=_F32)
        w = torch.randn(4, 5, generator=g, dtype=_F32)  # used as w.t(): (5, 4)
        out = torch.empty(2, 3, 4, dtype=_F32)
        addrs = torch.tensor([a[0].data_ptr(), a[1].data_ptr()], dtype=torch.int64)
        _fused.gemm_batch(address, 2, False, True, 3, 4, 5, 1.0, addrs.data_ptr(), 0, 0, 5,
                          0, w.data_ptr(), 0, 5, 0.0, out.data_ptr(), 12 * 4, 4)
        return bool(torch.allclose(out, torch.matmul(a, w.t()), rtol=1e-5, atol=1e-5))


def sgemm_batch() -> int:
    """The checked address of ``cblas_sgemm_batch``, or 0 (no extension, no MKL, a failed check)."""
    if not _ADDRESS:
        with _lock:
            if not _ADDRESS:
                address = 0
                if _fused is not None and hasattr(_fused, "gemm_batch"):
                    try:  # (its own tensors: no transform of the caller's may wrap them, reliability #209)
                        with torch._C.DisableTorchFunction(), outside_transforms():
                            found = _find()
                            address = found if found and _works(found) else 0
                    except Exception:  # a library that is not what its name says: keep the gathers
                        address = 0
                _ADDRESS.append(address)
    return _ADDRESS[0]


def _shared_works() -> bool:
    """Does ``_fused.gemm_shared`` run here and compute ``torch.matmul``'s products? (ragged sizes:
    rows not a multiple of its 8-row tile, columns not of its 32-column panel; both layouts of W)"""
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(3, 11, 7, generator=g, dtype=_F32)
        w = torch.randn(7, 37, generator=g, dtype=_F32)
        addrs = torch.tensor([a[i].data_ptr() for i in range(3)], dtype=torch.int64)
        want = torch.matmul(a, w)
        for wt, trans, ld in ((w, False, 37), (w.t().contiguous().t(), True, 7)):
            out = torch.full((3, 11, 37), 1.0, dtype=_F32)
            if not _fused.gemm_shared(3, 11, 7, 37, addrs.data_ptr(), 7, wt.data_ptr(), trans, ld, 1.0,
                                      out.data_ptr(), 11 * 37 * 4, 37):
                return False
            if not torch.allclose(out, want + 1.0, rtol=1e-5, atol=1e-5):
                return False
        return True


def shared_kernel() -> bool:
    """Is the AVX-512 per-node-rows-times-shared-matrix kernel (``_fused.gemm_shared``) on and checked?"""
    if not _SHARED:
        with _lock:
            if not _SHARED:
                ok = False
                if _fused is not None and hasattr(_fused, "gemm_shared"):
                    try:
                        with torch._C.DisableTorchFunction(), outside_transforms():
                            ok = _shared_works()
                    except Exception:  # a kernel that does not compute the product: MKL's batch serves
                        ok = False
                _SHARED.append(ok)
    return _SHARED[0]


def _shared_2d(w):
    """``(transposed, ld)`` for a 2-D float32 CPU matrix with one unit stride, or None."""
    if (type(w) is not _T and type(w) is not torch.nn.Parameter) or w.dim() != 2 or w.dtype is not _F32 \
            or not w.is_cpu or w.is_conj() or w.is_neg() or w._is_zerotensor():
        return None
    k, n = w.shape
    s0, s1 = w.stride()
    if s1 == 1 and s0 >= max(n, 1):
        return False, s0
    if s0 == 1 and s1 >= max(k, 1):
        return True, s1  # w is the transpose of a row-major (n, k) matrix
    return None


def _recorded_on() -> bool:
    """Autograd, forward-mode AD, a ``torch.func`` transform or autocast would need what a raw GEMM
    does not record, carry or cast (reliability #209: tangents came back None)."""
    return torch.is_grad_enabled() or torch._C._is_any_autocast_enabled() or tangents_possible()


def _refs_product(r, w, out, beta: float, live=None) -> bool:
    """``out[i] (+)= rows[i] @ w`` for RowRefs ``r`` of ``(M, K)`` rows and a shared ``(K, N)``,
    for ``i < live`` (None: every row); rows from ``live`` on are left NaN."""
    if len(r.shape) != 2 or out.shape[1:] != (r.shape[0], w.shape[1]) or r.shape[1] != w.shape[0] or 0 in out.shape \
            or r.shape[1] == 0:
        return False  # (empty products: torch's)
    lay = _shared_2d(w)
    if lay is None:
        return False
    m, k = r.shape
    n = w.shape[1]
    count = total = r.addrs.shape[0]
    if live is not None and 0 <= live < count:
        out[live:].fill_(float("nan"))  # (rows nothing reads: NaN, never a stale value)
        count = live
        if beta == 0.0:  # (a fresh output: its rows past live are left; an added product adds to NaN)
            _skipped(total - live)
        if count == 0:
            return True
    if shared_kernel() and _fused.gemm_shared(count, m, k, n, r.addrs.data_ptr(), k, w.data_ptr(), lay[0],
                                              lay[1], beta, out.data_ptr(), m * n * 4, n):
        return True
    if not sgemm_batch():
        if count != total and beta == 0.0:
            _skipped(count - total)  # (the caller computes every row after all)
        return False
    _fused.gemm_batch(sgemm_batch(), count, False, lay[0], m, n, k, 1.0, r.addrs.data_ptr(), 0, 0, k,
                      0, w.data_ptr(), 0, lay[1], beta, out.data_ptr(), m * n * 4, n)
    return True


def _left_product(w, addrs, k: int, n: int, ldb: int):
    """``w @ B_i`` for a shared 2-D float32 ``w`` ``(M, K)`` and per-node ``(K, N)`` matrices at
    ``addrs`` (int64, rows ``ldb`` floats apart), by ``_fused.gemm_left_shared`` (AVX-512: a panel
    of each node's matrix stays in L1 while every 8-row block of ``w`` runs over it; 177-189
    GFLOP/s against torch's 98-122 on 2 cores at MV-RNN's shapes; torch's broadcast of a 2-D
    matrix over a batch ran at 48 GFLOP/s on 1 core), or None (no kernel here, another dtype or
    layout: the caller runs torch's)."""
    if (not shared_kernel() or (type(w) is not _T and type(w) is not torch.nn.Parameter) or w.dtype is not _F32
            or not w.is_cpu or w.is_conj() or w.is_neg() or w._is_zerotensor() or w.dim() != 2 or w.shape[1] != k
            or 0 in w.shape or n == 0 or addrs.shape[0] == 0 or _recorded_on()):
        return None
    if w.stride(1) != 1 or w.stride(0) < w.shape[1]:
        w = w.contiguous()  # (a transposed or strided weight: one small copy a call)
    count, m = addrs.shape[0], w.shape[0]
    out = torch.empty((count, m, n), dtype=_F32)
    if _fused.gemm_left_shared(count, m, k, n, w.data_ptr(), w.stride(0), addrs.data_ptr(), ldb, 0.0, out.data_ptr(),
                               m * n * 4, n):
        return out
    return None


def _dense_rows(x):
    """The addresses of a dense float32 CPU ``(n, K, N)`` tensor's matrices (unit last stride), or None."""
    if (type(x) is not _T or x.dim() != 3 or x.dtype is not _F32 or not x.is_cpu or x.stride(2) != 1
            or x.stride(1) < x.shape[2] or x.is_conj() or x.is_neg() or x._is_zerotensor() or 0 in x.shape):
        return None
    return x.data_ptr() + torch.arange(x.shape[0], dtype=torch.int64) * (x.stride(0) * 4)


def matmul(a, b, live=None):
    """``torch.matmul(a, b)`` where ``a`` or ``b`` may be a :class:`RowRefs` (see module docstring).

    Shapes: ``RowRefs (n; M, K) @ (K, N)`` and ``(n, M, K) @ RowRefs (n; K, N)`` -> ``(n, M, N)``
    float32, computed from the rows in place (``M = 1`` on the right: ``_fused.gemv_rows``, which
    reads each matrix once where the batched GEMM packs it first: 12.1 -> 6.8 ms for MV-RNN
    h128's 1,939 vector products a batch at one thread); other cases as ``torch.matmul`` of the
    gathered rows. ``live``: only the first ``live`` nodes' products are needed (their other rows
    are an output nothing reads, execute.py's dead rows): a RowRefs-times-shared product computes
    those and leaves the rest NaN; every other case computes all rows.
    """
    ta, tb = type(a), type(b)
    if (ta is RowRefs or tb is RowRefs) and not _recorded_on() and (sgemm_batch() or shared_kernel()):
        if ta is RowRefs and tb is not RowRefs and isinstance(b, _T) and b.dim() == 2 and len(a.shape) == 2:
            out = torch.empty((a.addrs.shape[0], a.shape[0], b.shape[1]), dtype=_F32)
            if _refs_product(a, b, out, 0.0, live):
                return out
        elif tb is RowRefs and isinstance(a, _T) and a.dim() == 2 and len(b.shape) == 2:
            # (a shared matrix times each node's own: P = W_1 A + W_2 B)
            out = _left_product(a, b.addrs, b.shape[0], b.shape[1], b.shape[1])
            if out is not None:
                return out
        elif tb is RowRefs and ta is _T and a.dim() == 3 and len(b.shape) == 2 and a.dtype is _F32 and a.is_cpu \
                and a.shape[0] == b.addrs.shape[0] and a.shape[2] == b.shape[0] and a.stride(2) == 1 \
                and not (a.is_conj() or a.is_neg() or a._is_zerotensor()) and (a.shape[1] == 1 or a.stride(1) >= a.shape[2]) \
                and 0 not in a.shape and b.shape[1] > 0:
            count, m, k = a.shape
            n = b.shape[1]
            out = torch.empty((count, m, n), dtype=_F32)
            if m == 1:  # a row vector times each node's matrix: read each matrix once, unpacked
                _fused.gemv_rows(count, k, n, a.data_ptr(), a.stride(0) * 4, b.addrs.data_ptr(), n, out.data_ptr(), n * 4)
                return out
            if not sgemm_batch():
                return torch.matmul(a, materialize(b))
            lda = a.stride(1)
            _fused.gemm_batch(sgemm_batch(), count, False, False, m, n, k, 1.0, 0, a.data_ptr(), a.stride(0) * 4, lda,
                              b.addrs.data_ptr(), 0, 0, n, 0.0, out.data_ptr(), m * n * 4, n)
            return out
    elif ta is not RowRefs and tb is _T and isinstance(a, _T) and a.dim() == 2 and b.dim() == 3:
        # a shared matrix times a batch of dense per-node matrices (W_M @ cat([A, B])), as lowered
        # by rules._lower_matmul
        addrs = _dense_rows(b)
        if addrs is not None:
            out = _left_product(a, addrs, b.shape[1], b.shape[2], b.stride(1))
            if out is not None:
                return out
    return torch.matmul(materialize(a), materialize(b))


def matmul_accumulate(acc, y, w, live=None):
    """``acc + y @ w`` with ``acc`` a fresh product nothing else reads (as
    :func:`~batchcraft.autobatching.lower.matmul_accumulate`), where ``y`` may be a
    :class:`RowRefs` of ``(M, K)`` rows: ``y @ w`` is added into ``acc`` by one batched GEMM
    with beta 1, from the rows in place (``live``: as :func:`matmul`'s)."""
    if (type(y) is RowRefs and type(acc) is _T and acc.dtype is _F32 and acc.is_cpu and acc.is_contiguous()
            and acc.dim() == 3 and acc.shape[0] == y.addrs.shape[0] and isinstance(w, _T) and w.dim() == 2
            and not _recorded_on() and not acc.requires_grad and (sgemm_batch() or shared_kernel())):
        if _refs_product(y, w, acc, 1.0, live):
            return acc
    return acc + torch.matmul(materialize(y), w)


#: join a sum of two row products into one pass (tests and measurements switch it off)
JOIN_SUMS = True


def sum_of_products(x, w1, y, w2, live=None):
    """``x @ w1 + y @ w2`` with ``x``, ``y`` :class:`RowRefs` of ``(M, K1)``, ``(M, K2)`` per-node
    matrices and ``w1``, ``w2`` shared matrices: one pass of ``_fused.gemm_shared`` sums both
    products of each output tile in registers and writes it once (the two-call form writes the
    first product and reads it back to add the second: a third of the memory traffic of MV-RNN's
    ``P^T``). Rounding: one FMA chain over both sums (as one GEMM over the concatenated K would
    be), so values differ from the two calls' in the last bits. ``live``: as :func:`matmul`'s.
    Anything else: :func:`matmul_accumulate` over :func:`matmul`, as written."""
    if (JOIN_SUMS and type(x) is RowRefs and type(y) is RowRefs and len(x.shape) == 2 and len(y.shape) == 2
            and x.shape[0] == y.shape[0] and x.addrs.shape[0] == y.addrs.shape[0] and isinstance(w1, _T)
            and isinstance(w2, _T) and w1.dim() == 2 and w2.dim() == 2 and w1.shape[0] == x.shape[1]
            and w2.shape[0] == y.shape[1] and w1.shape[1] == w2.shape[1] and 0 not in w1.shape and 0 not in w2.shape
            and x.shape[0] > 0 and not _recorded_on() and shared_kernel()):
        l1, l2 = _shared_2d(w1), _shared_2d(w2)
        if l1 is not None and l2 is not None:
            count = x.addrs.shape[0]
            (m, k1), k2, n = x.shape, y.shape[1], w1.shape[1]
            out = torch.empty((count, m, n), dtype=_F32)
            total = count
            if live is not None and 0 <= live < count:
                out[live:].fill_(float("nan"))  # (rows nothing reads: NaN, never a stale value)
                count = live
            if count == 0 or _fused.gemm_shared(count, m, k1, n, x.addrs.data_ptr(), k1, w1.data_ptr(), l1[0], l1[1],
                                                0.0, out.data_ptr(), m * n * 4, n, k2, y.addrs.data_ptr(), k2,
                                                w2.data_ptr(), l2[0], l2[1]):
                _skipped(total - count)
                return out
    return matmul_accumulate(matmul(x, w1, live), y, w2, live)


__all__ = ["matmul", "matmul_accumulate", "sgemm_batch", "shared_kernel", "skipped_rows", "sum_of_products"]
