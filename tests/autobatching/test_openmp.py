"""Fused kernels, segment sums and row copies over torch's OpenMP team (openmp.py, _fused.c).

The team splits rows (kernels) or columns (segment sums, row copies), never the order of the
additions into one value: every result must be the same bits as on one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from batchcraft.autobatching import fuse, openmp

_fused = pytest.importorskip("batchcraft.autobatching._fused")

needs_team = pytest.mark.skipif(openmp.find() is None, reason="torch's parallel backend is not a loaded OpenMP runtime")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (a team of 2 even on one core: OpenMP oversubscribes, the bits must not move)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread_kernels():
    """Run a block with the team switched off, then back on as the process had it."""
    def serial(fn):
        openmp.uninstall(_fused)
        try:
            return fn()
        finally:
            openmp.install(_fused)
    return serial


def _kernel():
    """out0 = sigmoid(x)[:, 8:12] * x[:, 4:8]; out1 = tanh(x[:, 0:4]) + y: a scratch slot's view,
    an indexed input's view, a shared row."""
    slots = [(fuse.IN, 0, 12, 0), (fuse.IN, 1, 4, 0), (fuse.VIEW, 0, 4, 4), (fuse.VIEW, 0, 4, 0),
             (fuse.SCRATCH, 0, 12, 0), (fuse.VIEW, 4, 4, 8), (fuse.SCRATCH, 0, 4, 0),
             (fuse.OUT, 0, 4, 0), (fuse.OUT, 1, 4, 0)]
    ops = [(fuse.SIGMOID, 4, 0, -1, 0.0), (fuse.MUL, 7, 5, 2, 0.0), (fuse.TANH, 6, 3, -1, 0.0),
           (fuse.ADD, 8, 6, 1, 0.0)]
    return fuse.FusedCall(_fused.Kernel(slots, ops, 2, 2), ["b", "c"], [12, 4], [4, 4], 4)


@needs_team
def test_torchs_own_runtime_is_found_and_used():
    assert openmp.reason == ""
    assert openmp.find() is not None


@needs_team
def test_team_size_follows_torchs_threads_and_the_work(two_threads):
    assert _fused.team(10_000, 10_000 * 256) == 2
    assert _fused.team(8, 8 * 256) == 1            # below the grain: one thread
    assert _fused.team(1, 10 ** 9) == 1            # one row cannot be split
    torch.set_num_threads(1)
    assert _fused.team(10_000, 10_000 * 256) == 1


@needs_team
@pytest.mark.parametrize("rows", [0, 1, 7, 5000])
def test_a_kernel_on_the_team_is_one_threads_bits(rows, two_threads, one_thread_kernels):
    g = torch.Generator().manual_seed(rows)
    buf = torch.randn(rows + 3, 12, generator=g) * 4
    from batchcraft.autobatching.gather import Rows

    x = Rows(buf, torch.randint(0, rows + 3, (rows,), generator=g))
    y = torch.randn(4, generator=g)
    fc = _kernel()
    got = fc(rows, None, x, y)
    want = one_thread_kernels(lambda: fc(rows, None, x, y))
    assert got is not None and want is not None
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    xs = buf[x.index]
    torch.testing.assert_close(got[0], torch.sigmoid(xs)[:, 8:12] * xs[:, 4:8], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], torch.tanh(xs[:, :4]) + y, atol=1e-6, rtol=1e-5)


@needs_team
@pytest.mark.parametrize("rows,width,n", [(3000, 256, 40), (3000, 37, 5), (0, 256, 7), (50, 1000, 3)])
def test_a_segment_sum_on_the_team_is_index_adds_bits(rows, width, n, two_threads, one_thread_kernels):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width, generator=g)
    seg = torch.randint(0, n, (rows,), generator=g)
    got = fuse.segment_sum(x, seg, n)
    assert torch.equal(got, torch.zeros(n, width).index_add_(0, seg, x))
    assert torch.equal(got, one_thread_kernels(lambda: fuse.segment_sum(x, seg, n)))


def test_a_segment_sum_zeroes_its_own_output():
    """seg_sum writes every output row, those no segment names too (the caller's buffer is empty)."""
    out = torch.full((4, 8), float("nan"))
    x = torch.ones(3, 8)
    seg = torch.tensor([0, 0, 2])
    _fused.seg_sum(out.data_ptr(), x.data_ptr(), seg.data_ptr(), 3, 8, 8, 4)
    assert torch.equal(out, torch.tensor([[2.0] * 8, [0.0] * 8, [1.0] * 8, [0.0] * 8]))
    out = torch.full((2, 8), float("nan"))
    _fused.seg_sum(out.data_ptr(), 0, 0, 0, 8, 8, 2)  # no rows: zeros
    assert torch.equal(out, torch.zeros(2, 8))


@needs_team
def test_row_copies_on_the_team_keep_the_last_write(two_threads, one_thread_kernels):
    g = torch.Generator().manual_seed(3)
    src = torch.randn(500, 300, generator=g)
    dst_rows = torch.randint(0, 200, (2000,), generator=g)  # rows written several times: the last wins
    src_rows = torch.randint(0, 500, (2000,), generator=g)

    def copy():
        out = torch.zeros(200, 300)
        _fused.copy_rows(out.data_ptr(), dst_rows.data_ptr(), src.data_ptr(), src_rows.data_ptr(), 1200, 1200,
                         2000, 200, 500)
        return out

    got = copy()
    want = torch.zeros(200, 300)
    for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
        want[d] = src[s]
    assert torch.equal(got, want)
    assert torch.equal(got, one_thread_kernels(copy))


@needs_team
def test_kernels_called_from_two_threads_at_once_stay_right(two_threads):
    fc = _kernel()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4000, 12, generator=g) for _ in range(2)]
    y = torch.randn(4, generator=g)
    want = [fc(4000, None, x, y) for x in xs]
    bad = []

    def run(i):
        torch.set_num_threads(2)
        for _ in range(20):
            got = fc(4000, None, xs[i], y)
            if not all(torch.equal(a, b) for a, b in zip(got, want[i])):
                bad.append(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts) and not bad


@needs_team
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_runs_kernels_on_one_thread(two_threads):
    fc = _kernel()
    x, y = torch.randn(5000, 12), torch.randn(4)
    want = fc(5000, None, x, y)  # the parent's team exists now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            got = fc(5000, None, x, y)
            ok = all(torch.equal(a, b) for a, b in zip(got, want)) and openmp.reason.startswith("a forked")
            code = 0 if ok and _fused.team(10_000, 10_000 * 256) == 1 else 1
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    import select

    ready, _, _ = select.select([r], [], [], 120)
    assert ready, "the forked child hung"
    assert os.read(r, 1) == b"\x00"
    os.close(r)
    os.waitpid(pid, 0)


def test_the_switch_keeps_every_call_on_one_thread():
    code = ("import torch\nfrom batchcraft.autobatching import fuse, openmp, _fused\n"
            "torch.set_num_threads(2)\n"
            "assert openmp.reason == 'BATCHCRAFT_FUSED_THREADS=1', openmp.reason\n"
            "assert _fused.team(10000, 10000 * 256) == 1\nprint('ok')\n")
    env = dict(os.environ, BATCHCRAFT_FUSED_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_set_openmp_takes_all_four_entry_points_or_none():
    with pytest.raises(ValueError):
        _fused.set_openmp(1, 0, 0, 0)
