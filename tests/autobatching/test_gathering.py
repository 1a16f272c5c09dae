"""Gathering (``gather.py``): rows of several buffers copied once into their final order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchcraft.autobatching import gather


def _cat_path(buffers, plan):
    """The reference: each buffer's rows, a cat, then the reorder."""
    pieces = [gather.select_rows(buffers[b], torch.tensor(rows, dtype=torch.int64)) for b, rows in plan[1]]
    cat = torch.cat(pieces)
    return cat if plan[2] is None else cat[torch.tensor(plan[2], dtype=torch.int64)]


@st.composite
def plans(draw):
    shape = draw(st.sampled_from([(3,), (2, 3), (1, 4, 2)]))
    n_buf = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 6)) for _ in range(n_buf)]
    pieces = []
    for b, size in enumerate(sizes):
        k = draw(st.integers(1, size))
        if draw(st.booleans()):
            r0 = draw(st.integers(0, size - k))
            rows = list(range(r0, r0 + k))  # consecutive: copied as a slice
        else:
            rows = draw(st.lists(st.integers(0, size - 1), min_size=k, max_size=k))
        pieces.append((b, rows if draw(st.booleans()) else bytearray(torch.tensor(rows).numpy().tobytes())))
    total = sum(len(r) if type(r) is list else len(r) // 8 for _, r in pieces)
    perm = draw(st.permutations(list(range(total)))) if draw(st.booleans()) else None
    strided = draw(st.booleans())
    return shape, sizes, pieces, perm, strided


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=plans(), seed=st.integers(0, 2 ** 16))
def test_rows_of_several_buffers_equal_the_cat_path(p, seed):
    shape, sizes, pieces, perm, strided = p
    g = torch.Generator().manual_seed(seed)
    buffers = []
    for size in sizes:
        t = torch.randn((size, *shape), generator=g)
        if strided and len(shape) == 1:  # rows of a wider buffer: row stride > width
            t = torch.randn(size, shape[0] + 2, generator=g)[:, 1:1 + shape[0]]
        buffers.append(t)
    plan = ("pieces", [(b, r) for b, r in pieces], perm)
    ref = _cat_path(buffers, ([], [(b, list(torch.frombuffer(r, dtype=torch.int64).tolist()) if type(r) is bytearray
                                    else r) for b, r in pieces], perm))
    got = gather._take(buffers, plan)
    assert got.shape == ref.shape and torch.equal(got, ref)


def test_autograd_and_mixed_dtypes_take_the_cat_path():
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(2, 3)
    plan = ("pieces", [(0, [3, 1]), (1, [0])], [2, 0, 1])
    out = gather._take([a, b], plan)
    assert out.requires_grad  # the history through the rows is kept
    out.sum().backward()
    assert a.grad[3].sum() == 3 and a.grad[1].sum() == 3 and a.grad[0].sum() == 0
    assert gather._take_pieces([a.detach(), b.double()], plan[1], plan[2]) is None
    with torch.no_grad():
        assert gather._take_pieces([a, b], plan[1], None) is not None  # in order: torch's copies
        # interleaved: the extension's row copies, or (without a compiler) the cat path
        assert (gather._take_pieces([a, b], plan[1], plan[2]) is None) == (gather._fused is None)


@pytest.mark.skipif(gather._fused is None, reason="the in-place reorder needs the _fused extension")
def test_copy_rows_checks_its_indices():
    out, src = torch.zeros(2, 3), torch.randn(4, 3)
    dst_rows, src_rows = torch.tensor([0, 1]), torch.tensor([3, 4])
    with pytest.raises(IndexError):
        gather._fused.copy_rows(out.data_ptr(), dst_rows.data_ptr(), src.data_ptr(), src_rows.data_ptr(), 12, 12, 2, 2, 4)
    assert not out.any()


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_conjugate_and_negative_views_are_gathered_by_value(view):
    # hostile pass, stop 39 (#192): the row copies of an interleaved gather read the memory of a
    # conj / neg view, not its values (silently wrong: up to 3.07 off in a complex tree model)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    a = a.conj() if view == "conj" else torch._neg_view(a)
    b = torch.randn(3, 3, dtype=torch.complex64, generator=g)
    for perm in (None, [2, 0, 3, 1]):
        plan = ("pieces", [(0, [3, 1]), (1, [0, 2])], perm)
        with torch.no_grad():
            got = gather._take([a, b], plan)
        assert torch.equal(got, _cat_path([a, b], plan))


# -- small gathers: one C call (_fused.gather_pieces) ------------------------------------------------

@pytest.mark.skipif(gather._fused is None, reason="the one-call gather needs the _fused extension")
@pytest.mark.parametrize("limit", [0, gather.SMALL_GATHER_BYTES], ids=["torch-copies", "one-call"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(p=plans(), seed=st.integers(0, 2 ** 16))
def test_both_gather_paths_equal_the_cat_path(limit, monkeypatch, p, seed):
    monkeypatch.setattr(gather, "SMALL_GATHER_BYTES", limit)
    test_rows_of_several_buffers_equal_the_cat_path.hypothesis.inner_test(p, seed)


@pytest.mark.skipif(gather._fused is None, reason="the one-call gather needs the _fused extension")
def test_small_gathers_read_expanded_strided_and_permuted_buffers_by_value():
    g = torch.Generator().manual_seed(1)
    expanded = torch.randn(1, 4, generator=g).expand(5, 4)          # every row the same memory
    narrow = torch.randn(6, 9, generator=g)[:, 2:6]                 # rows 9 floats apart
    scalars = torch.randn(7, generator=g)[::2]                      # scalar rows 2 apart
    cube = torch.randn(4, 2, 3, generator=g).transpose(1, 2)        # rows not contiguous: general path
    for bufs in ([expanded, narrow], [scalars, torch.randn(3, generator=g)], [cube, torch.randn(2, 3, 2, generator=g)]):
        plan = ("pieces", [(0, [2, 0]), (1, [1, 1])], [3, 0, 2, 1])
        with torch.no_grad():
            assert torch.equal(gather._take(bufs, plan), _cat_path(bufs, plan))
    assert gather._small_gather([cube], [(0, [0])], None, cube, False) is None


@pytest.mark.skipif(gather._fused is None, reason="the one-call gather needs the _fused extension")
def test_gather_pieces_checks_rows_perm_and_sizes():
    src = torch.arange(12.0).view(4, 3)
    out = torch.zeros(2, 3)
    fp = gather._fused.gather_pieces
    piece = (src.data_ptr(), 12, 4, [3, 0])
    fp(out.data_ptr(), 2, 12, (piece,), bytearray(torch.tensor([1, 0]).numpy().tobytes()))
    assert torch.equal(out, src[[0, 3]])
    with pytest.raises(IndexError):
        fp(out.data_ptr(), 2, 12, ((src.data_ptr(), 12, 4, [3, 4]),), None)    # row 4 of 4
    with pytest.raises(IndexError):
        fp(out.data_ptr(), 2, 12, (piece,), [0, 2])                            # perm past the rows
    with pytest.raises(ValueError):
        fp(out.data_ptr(), 2, 12, (piece,), [0])                               # perm of 1 of 2 rows
    with pytest.raises(ValueError):
        fp(out.data_ptr(), 3, 12, (piece,), None)                              # fewer rows than total
    with pytest.raises(ValueError):
        fp(out.data_ptr(), 1, 12, (piece,), None)                              # more rows than total
    with pytest.raises(ValueError):
        fp(out.data_ptr(), 2, 12, ((src.data_ptr(), 12),), None)               # a malformed piece
    with pytest.raises(ValueError):
        fp(out.data_ptr(), 2, 12, ((src.data_ptr(), 12, 4, bytearray(3)),), None)  # not int64 bytes
    assert torch.equal(out, src[[0, 3]])  # no failed call wrote a row


@pytest.mark.parametrize("reorder", [False, True], ids=["in-order", "reordered"])
@pytest.mark.parametrize("row", [(0,), (3, 0)])
def test_rows_of_no_elements_gather_from_several_buffers(reorder, row):
    """Reliability #212 (hostile helper, stop 42): a gather from several buffers of rows with no
    elements (no address: ``data_ptr()`` is 0) raised ValueError from the one-call gather (new) and,
    reordered, from the row copies (present before); eager's values are empty rows."""
    def fn(inst):
        x, k = inst
        h = x * 2 if k < 3 else x + 1   # two signatures: the rows lie in two buffers
        return h - 1

    order = [5, 0, 4, 1, 3, 2] if reorder else range(6)
    insts = [(torch.zeros(row), k) for k in order]
    from batchcraft import autobatch

    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            outs = autobatch(fn)(insts)
        assert [tuple(o.shape) for o in outs] == [row] * 6
    plan = ("pieces", [(0, [1, 0]), (1, [0])], [2, 0, 1] if reorder else None)
    with torch.no_grad():
        assert gather._take([torch.zeros(2, *row[1:]), torch.zeros(1, *row[1:])], plan).shape == (3, *row[1:])
