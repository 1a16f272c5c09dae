"""``torch.tensor([word_id])`` and ``torch.as_tensor(...)`` of Python scalars inside instance code:
per-instance leaves made without the general path (recorder.RecorderBase.list_leaf, the C core's
list_leaf_c), with eager's values, dtypes, errors and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch
from batchcraft.errors import InstanceError

from equivalence import CORES, assert_matches_eager, general_path_calls


FACTORIES = {
    "list": lambda i: torch.tensor([i]),
    "tuple-of-two": lambda i: torch.tensor((i, i + 1)),
    "float-dtype": lambda i: torch.tensor([i, 2 * i], dtype=torch.float32),
    "floats": lambda i: torch.tensor([i / 3, 0.5]),
    "bools": lambda i: torch.tensor([i % 2 == 0, True]),
    "int-to-bool": lambda i: torch.tensor([i, 0], dtype=torch.bool),
    "float-to-int64": lambda i: torch.tensor([i + 0.7], dtype=torch.int64),
    "as_tensor-scalar": lambda i: torch.as_tensor(i),
    "as_tensor-list": lambda i: torch.as_tensor([i, 3], device="cpu"),
    "mixed-types": lambda i: torch.tensor([i, 2.5]),       # (the general path: eager's promotion)
    "bool-and-int": lambda i: torch.tensor([True, i]),
    "long": lambda i: torch.tensor(list(range(i, i + 70))),  # (past MAX_LIST_LEAF: the general path)
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factories_of_python_scalars_equal_eager(core, name):
    make = FACTORIES[name]

    def fn(i):
        t = make(i)
        return t, t.dtype, tuple(t.shape), t * 2 if t.dtype is not torch.bool else ~t

    xs = list(range(7))
    for out, i in zip(autobatch(fn, core=core)(xs), xs):
        ref = fn(i)
        assert out[1:3] == ref[1:3], name
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[3], ref[3])


@pytest.mark.parametrize("core", CORES)
def test_word_id_lists_feed_an_embedding_with_eager_gradients(core):
    torch.manual_seed(0)
    emb, lin = nn.Embedding(20, 6), nn.Linear(6, 3)

    def fn(sentence):
        hs = [lin(emb(torch.tensor([w]))) for w in sentence]  # (1, 6) per word, as tutorials write it
        pair = emb(torch.as_tensor(sentence[:2])).sum(0)
        return torch.cat(hs).tanh().sum(0) + lin(pair)

    sentences = [[1, 5, 7], [2], [19, 0, 3, 3], [4, 4]]
    f = assert_matches_eager(fn, sentences, list(emb.parameters()) + list(lin.parameters()), core=core)
    assert f.stats.fallbacks == 0


@pytest.mark.parametrize("core", CORES)
def test_the_values_are_copied_at_the_call(core):
    def fn(i):
        ids = [i, i + 1]
        t = torch.tensor(ids)
        ids[0] = 100  # eager copied the list: t keeps i
        u = torch.tensor(ids)
        return t + 0, u + 0

    for out, i in zip(autobatch(fn, core=core)([1, 2, 3]), [1, 2, 3]):
        assert out[0].tolist() == [i, i + 1] and out[1].tolist() == [100, i + 1]


@pytest.mark.parametrize("core", CORES)
def test_in_place_updates_and_requires_grad_of_a_list_leaf(core):
    w = torch.randn(2, requires_grad=True)

    def fn(i):
        t = torch.tensor([float(i), 1.0])
        t.mul_(2)               # in place on the leaf, before any use
        s = torch.tensor([0.5, float(i)])
        s.requires_grad_()
        return t * w + s * s, s

    xs = [1, 2, 3]
    out = autobatch(fn, core=core)(xs)
    ref = [fn(i) for i in xs]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o[0], r[0])
        assert o[1].requires_grad and o[1].is_leaf == r[1].is_leaf
    go = torch.autograd.grad(sum(o[0].sum() for o in out), [w] + [o[1] for o in out])
    gr = torch.autograd.grad(sum(r[0].sum() for r in ref), [w] + [r[1] for r in ref])
    for a, b in zip(go, gr):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("bad, error", [(lambda i: torch.tensor([300 + i], dtype=torch.int8), "overflow"),
                                        (lambda i: torch.tensor([2 ** 63 + i]), "Overflow")])
def test_values_eager_refuses_raise_at_the_call_as_in_eager(core, bad, error):
    def fn(i):
        return bad(i) if i == 2 else torch.tensor([i])

    with pytest.raises(InstanceError, match=error) as info:
        autobatch(fn, core=core)([0, 1, 2, 3])
    assert info.value.instance == 2


def test_steady_calls_make_list_leaves_without_the_general_path(monkeypatch):
    # each torch.tensor([w]) took the general path: the mode's dispatch, a tensor made at once,
    # a leaf of it (about 7.5 µs a call; 0.35 µs now)
    from batchcraft.autobatching import _native

    if not _native.available:
        pytest.skip("the C core was not built")
    emb = nn.Embedding(20, 4)

    def fn(sentence):
        out = [emb(torch.tensor([w])) for w in sentence]
        out.append(emb(torch.as_tensor(sentence[0])))
        out.append(emb(torch.tensor(sentence[:2], dtype=torch.int64)))
        return torch.cat([o.reshape(-1, 4) for o in out])

    sentences = [[1, 5, 7], [2, 9], [19, 0, 3, 3]]
    out, calls = general_path_calls(fn, sentences, monkeypatch)
    assert calls == []
    with torch.no_grad():
        for o, s in zip(out, sentences):
            torch.testing.assert_close(o, fn(s))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("make", [
    lambda bad: torch.tensor([1.0, float("nan") if bad else 2.0], dtype=torch.int64),
    lambda bad: torch.as_tensor((1e30 if bad else 2.0,), dtype=torch.int64),
    lambda bad: torch.tensor(float("inf") if bad else 2.0, dtype=torch.int64),
    lambda bad: torch.as_tensor(300 if bad else 3, dtype=torch.int8),
    lambda bad: torch.as_tensor(1e20 if bad else 0.0, dtype=torch.int32),
], ids=["list-nan", "as_tensor-list-1e30", "scalar-inf", "as_tensor-int8", "as_tensor-int32"])
def test_conversions_eager_refuses_raise_at_the_call_and_can_be_caught(core, make):
    # reliability #256: float into int64 (and as_tensor scalars into narrow ints) converted at the
    # flush: a bare RuntimeError naming no instance, which instance code could not catch
    with pytest.raises(InstanceError, match="cannot be converted") as info:
        autobatch(lambda i: make(i == 2) + 0, core=core)([0, 1, 2, 3])
    assert info.value.instance == 2

    def caught(i):
        try:
            return make(i == 2).reshape(-1)[:1].to(torch.int64) + 0
        except RuntimeError:
            return torch.tensor([-1])

    out = autobatch(caught, core=core)([0, 1, 2, 3])
    assert [o.tolist() for o in out] == [caught(i).tolist() for i in range(4)]
