"""Rows of an output nothing reads are left uncomputed (execute.DEAD_ROWS, lower._cut_output).

MV-RNN's last composition of each sentence makes a ``P^T`` that the instance drops: the executor
puts those nodes last (``Recorder.dead_last``) and the row products that alone make ``P^T``
compute only the others. Every way a value can still be read must keep its rows computed: a
returned value, a later operation, a value kept on a module, a value held
across a flush (``.item()``), grad mode; and the results always equal eager.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch
from batchcraft.autobatching import execute, gather, rowmm

from equivalence import assert_matches_eager
from mvblocks import compose_words, mv_blocks

needs_products = pytest.mark.skipif(not (rowmm.sgemm_batch() or rowmm.shared_kernel()),
                                    reason="no row products in this build (no extension)")

H = 32


def _model(use: str, holder=None):
    leaf, compose, params = mv_blocks(H)

    def synced(v):  # a flush while M is held
        return v * 2 if v.sum().item() > 1e9 else v

    def fn(words):
        v, M = compose_words(leaf, compose, words, synced if use == "sync" else None)
        if use == "both":
            return v, M
        if use == "read":
            return v + M.sum(0)
        if use == "held":  # module state: batchcraft hands it back concrete
            holder.kept.append(M)
        return v

    return fn, params


def _sentences(seed=1, count=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 30, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (count,), generator=g)]


@pytest.fixture
def small_rows(monkeypatch):
    monkeypatch.setattr(gather, "ROW_REFS_MIN_BYTES", 1024)  # H 32: 4 KiB rows, read in place


@needs_products
def test_the_dropped_matrix_of_each_last_composition_is_not_computed(small_rows):
    fn, _ = _model("p")
    sents = _sentences()
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [])
    assert f.stats.rows_dead == len(sents)  # one last composition a sentence (each has >= 2 words)
    assert "left uncomputed" in f.stats.summary()


@needs_products
@pytest.mark.parametrize("use", ["both", "read", "sync"])
def test_a_matrix_still_read_is_computed(use, small_rows):
    fn, _ = _model(use)
    with torch.no_grad():
        f = assert_matches_eager(fn, _sentences(2), [])
    if use != "sync":  # (a flush before the last composition's M is dropped: nothing is dead then)
        assert f.stats.rows_dead == 0


@needs_products
def test_a_matrix_kept_on_a_module_is_computed(small_rows):
    hb, he = nn.Module(), nn.Module()
    hb.kept, he.kept = [], []
    fn_b, _ = _model("held", hb)
    fn_e, _ = _model("held", he)
    sents = _sentences(3)
    with torch.no_grad():
        f = autobatch(fn_b)
        out = f(sents)
        ref = [fn_e(s) for s in sents]
    assert f.stats.rows_dead == 0
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(hb.kept) == len(he.kept) == len(sents)
    for a, b in zip(hb.kept, he.kept):
        assert type(a) is torch.Tensor and not torch.isnan(a).any()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_products
def test_off_switch_python_core_and_grad_mode_compute_every_row(small_rows, monkeypatch):
    fn, params = _model("p")
    sents = _sentences(4)
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [], core="python")
    assert f.stats.rows_dead == 0
    f = assert_matches_eager(fn, sents, params)  # grad mode: values and gradients
    assert f.stats.rows_dead == 0
    monkeypatch.setattr(execute, "DEAD_ROWS", False)
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [])
    assert f.stats.rows_dead == 0


@needs_products
def test_the_program_cuts_only_the_output_its_row_products_alone_make(small_rows):
    fn, _ = _model("p")
    with torch.no_grad():
        f = autobatch(fn)
        f(_sentences(5))
    from batchcraft.autobatching.execute import program_of
    from batchcraft.autobatching.signature import SIGNATURES
    cut = {}
    for info in list(SIGNATURES.by_sid):
        try:
            prog = program_of(info)
        except Exception:
            continue
        for runner in prog.lowered.values():
            if getattr(runner, "source", "") and prog.name.endswith("Compose"):
                cut[prog.name] = (runner.taken.cut_out, runner.source)
    assert cut
    for out, src in cut.values():
        assert out == 1  # P^T, not p (which the tanh of a per-node value makes)
        want = 1 if rowmm.JOIN_SUMS else 2  # the joined sum, or the product and the one added into it
        assert src.count(", L)") == want


@needs_products
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_rows_dead_counts_only_rows_left_uncomputed(dtype, small_rows):
    # hostile helper, stop 54: rows_dead counted the cut rows of every group run with a live
    # count, also where the products computed every row (other dtypes: torch's matmul)
    fn, params = _model("p")
    for p in params:
        p.data = p.data.to(dtype)
    sents = _sentences(6)
    with torch.no_grad():
        f = assert_matches_eager(fn, sents, [], atol=1e-2 if dtype is torch.float16 else 1e-5)
    assert f.stats.rows_dead == 0
