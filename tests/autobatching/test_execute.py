"""Execution details: gathers from several sources, output arenas, flushes mid-recording."""

from __future__ import annotations

import pytest
import torch

from batchcraft import autobatch, static_block

from equivalence import CORES, assert_matches_eager


def _children_program(cell):
    def fn(inst):
        x, n_children = inst
        hs = [torch.tanh(x * (j + 1)) for j in range(n_children)]
        return cell(x, hs)
    return fn


@static_block
def _sum_cell(x, hs):
    if hs:
        return x + torch.stack(hs, dim=-2).sum(-2)
    return x * 2


@pytest.mark.parametrize("grad", [False, True])
def test_list_arguments_of_mixed_sources_equal_eager(grad):
    torch.manual_seed(0)
    insts = [(torch.randn(5, requires_grad=grad), k) for k in (0, 1, 2, 3, 2, 3, 1, 0, 3)]
    with torch.set_grad_enabled(grad):
        assert_matches_eager(_children_program(_sum_cell), insts, [x for x, _ in insts])


def test_outputs_of_groups_of_one_kind_share_an_arena_in_inference():
    lin = torch.nn.Linear(6, 6)

    @static_block
    def step(h):
        return torch.tanh(lin(h))

    def fn(inst):
        h, n = inst
        for _ in range(n):
            h = step(h)
        return h

    torch.manual_seed(1)
    insts = [(torch.randn(6), n) for n in (1, 3, 2, 3, 1)]
    f = autobatch(fn)
    with torch.no_grad():
        out = f(insts)
        ref = [fn(x) for x in insts]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    # the three depths of `step` wrote into one buffer: every output is a row of the same tensor
    bases = {o.untyped_storage().data_ptr() for o in out}
    assert len(bases) == 1


def test_no_arena_when_autograd_records():
    lin = torch.nn.Linear(6, 6)

    @static_block
    def step(h):
        return torch.tanh(lin(h))

    def fn(inst):
        h, n = inst
        for _ in range(n):
            h = step(h)
        return h

    insts = [(torch.randn(6), n) for n in (1, 3, 2, 3, 1)]
    out = autobatch(fn)(insts)  # grad on: each group keeps its own output tensor
    bases = {o.untyped_storage().data_ptr() for o in out}
    assert len(bases) == 3  # one per depth reached by some instance's last step
    for o, x in zip(out, insts):
        torch.testing.assert_close(o, fn(x))



def test_arena_keeps_eager_layout_so_view_works_as_in_eager():
    """Break-it report A: copying a non-contiguous result into an arena changed its strides, so a
    later ``.view()`` that works eagerly failed."""

    def fn(x):  # x: (2, 3)
        a = x.t() * 2  # non-contiguous, as in eager
        b = a.t() * 2  # contiguous in eager: a.t() is
        c = b.t() * 2  # same op and output shape as `a`: would share an arena with it
        return b.view(-1), c

    torch.manual_seed(3)
    xs = [torch.randn(2, 3) for _ in range(4)]
    with torch.no_grad():
        out = autobatch(fn)(xs)
        for (b, c), x in zip(out, xs):
            rb, rc = fn(x)
            torch.testing.assert_close(b, rb)
            torch.testing.assert_close(c, rc)
            assert c.stride() == rc.stride()


def test_outputs_that_alias_in_eager_are_equal_and_editing_one_instance_leaves_the_others():
    """Break-it report B. Eager's ``(a, a.t(), a[0])`` share memory; batched, ``a.t()`` and ``a[0]``
    are computed from a gathered copy of ``a`` when its rows come from several groups (with or
    without arenas), so they come back equal but separate (README, differences from eager). What
    must hold: equal values, and an in-place edit of one instance's output changes no other
    instance's outputs."""

    def fn(inst):
        x, n = inst
        a = x
        for _ in range(n):
            a = torch.tanh(a)
        return a, a.t(), a[0]

    torch.manual_seed(4)
    insts = [(torch.randn(3, 3), n) for n in (1, 2, 3, 1, 2, 3)]
    with torch.no_grad():
        out = autobatch(fn)(insts)
        for o, inst in zip(out, insts):
            for t, r in zip(o, fn(inst)):
                torch.testing.assert_close(t, r)
        before = [[t.clone() for t in o] for o in out]
        for t in out[0]:
            t.add_(1)
        for o, b in zip(out[1:], before[1:]):
            assert all(torch.equal(t, u) for t, u in zip(o, b))


W3 = torch.randn(3)


@pytest.mark.parametrize("make, expected", [
    (lambda v: torch.tensor(v, dtype=torch.float64) * W3, torch.float32),
    (lambda v: torch.tensor(int(v)) * torch.ones(3, dtype=torch.int32), torch.int32),
    (lambda v: (torch.tensor(v, dtype=torch.float64) * W3) @ torch.eye(3), torch.float32),
])
def test_zero_dim_per_instance_values_promote_like_eager(make, expected):
    """Break-it report C: a batched 0-dim argument counted as a dimensioned tensor in type promotion
    (float64 instead of float32); the executor now checks output dtypes and falls back."""
    xs = [1.5, 2.5, -0.5]
    out = autobatch(make)(xs)
    for o, v in zip(out, xs):
        ref = make(v)
        assert o.dtype == ref.dtype == expected
        torch.testing.assert_close(o, ref)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_index_plans_of_one_buffer_are_one_gather_with_the_same_rows(as_bytes, monkeypatch):
    from array import array

    from batchcraft.autobatching import gather

    bufs = [torch.randn(10, 3), torch.randn(4, 3)]
    rows = (lambda r: bytearray(array("q", r).tobytes())) if as_bytes else list
    plans = [("index", 0, rows([1, 3])), ("view", 1, 1, 2), ("index", 0, rows([2, 0, 9])), ("index", 1, rows([3, 0]))]
    want = [gather.take(bufs, p) for p in plans]
    calls = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, *a: calls.append(t.shape) or real(t, *a))
    got = gather.take_all(bufs, plans)
    assert [tuple(s) for s in calls] == [(10, 3), (4, 3)]  # buffer 0 once for its two plans
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_lstm_cell_block_chain_writes_arenas_and_gathers_no_hoisted_input(monkeypatch):
    # BiRNN's pattern: the cell's outputs (views of a squeezed batch) go into one arena per output,
    # and the per-step groups gather only h and c (x is read by the hoisted input projection)
    from batchcraft.autobatching import execute

    torch.manual_seed(5)
    emb = static_block(torch.nn.Embedding(20, 6))
    cell = static_block(torch.nn.LSTMCell(6, 5))

    def rnn(ids):
        h = c = torch.zeros(5)
        hs = []
        for w in ids:
            h, c = cell(emb(torch.tensor(w)), (h, c))
            hs.append(h)
        return torch.stack(hs)

    seqs = [[(3 * i + j) % 20 for j in range(n)] for i, n in enumerate((4, 9, 2, 6, 9))]
    gathered, placed = [], []
    real_take_all, real_arena = execute.take_all, execute.Executor._into_arena
    monkeypatch.setattr(execute, "take_all", lambda bufs, plans, *a: gathered.append(len(plans))
                        or real_take_all(bufs, plans, *a))
    monkeypatch.setattr(execute.Executor, "_into_arena",
                        lambda self, *a: placed.append(real_arena(self, *a)) or placed[-1])
    with torch.no_grad():  # the per-step path (chains.py would run the chains as one layer call)
        f = assert_matches_eager(rnn, seqs, [], fuse_recurrences=False)
    assert f.stats.groups_by_rule.get("hoisted") == 1
    assert placed and all(p is not None for p in placed)
    assert gathered.count(2) >= 8  # steps 1..8: h and c only
    assert 3 not in gathered


@pytest.mark.parametrize("packed", [True, False])
def test_recurrences_run_in_packed_order_and_read_their_state_as_views(packed, monkeypatch):
    # instances stop at different steps; longest first, each step's h and c are the first rows
    # of the previous step's (no index_select), and the values are eager's either way
    from batchcraft.autobatching import execute, gather

    torch.manual_seed(6)
    cell = static_block(torch.nn.GRUCell(4, 3))

    def rnn(xs):
        h = torch.zeros(3)
        for x in xs:
            h = cell(x, h)
        return h

    seqs = [torch.randn(n, 4) for n in (3, 9, 1, 6, 9, 2, 5, 7) * 5]
    kinds = []
    real = gather.take_all
    monkeypatch.setattr(execute, "take_all", lambda bufs, plans, *a: kinds.extend(p[0] for p in plans) or real(bufs, plans, *a))
    with torch.no_grad():
        assert_matches_eager(rnn, seqs, [], packed_order=packed, fuse_recurrences=False)
    gathers = sum(k != "view" for k in kinds)
    if packed:  # the first step reads the stacked torch.zeros leaves in the new order; then views
        assert gathers <= 1, kinds
    else:
        assert gathers >= 5, kinds


def test_packed_order_leaves_tree_cells_and_small_signatures_alone():
    from batchcraft.autobatching.order import packed_order

    class Rec:
        def group_instances(self, nodes):
            return [nd // 10 for nd in nodes]  # node id // 10 = its instance

    tree = [((0, 1, 7), [10, 11, 20]), ((0, 2, 7), [12, 21])]   # instance 1 twice at depth 1
    chain = [((0, 1, 8), [k * 10 + 5 for k in range(40)]),
             ((0, 2, 8), [k * 10 + 6 for k in range(0, 40, 2)])]  # even instances go on
    groups = tree + chain
    assert packed_order(Rec(), groups) == 1
    assert groups[0][1] == [10, 11, 20] and groups[1][1] == [12, 21]
    first = groups[2][1]
    assert first[:20] == [k * 10 + 5 for k in range(0, 40, 2)]  # two steps: first
    assert first[20:] == [k * 10 + 5 for k in range(1, 40, 2)]


@pytest.mark.parametrize("core", CORES)
def test_groups_with_big_rows_run_in_their_largest_inputs_source_order(core):
    # MV-RNN's pattern: per-node matrices (4 KiB rows and more) read out of their producers' row
    # order; the consumer group then runs in its largest argument's source order (its gather
    # needs no permutation), with eager's values and gradients
    from batchcraft.autobatching import execute

    torch.manual_seed(7)
    mix = static_block(torch.nn.Linear(32, 32))
    w = torch.nn.Parameter(torch.randn(32))

    def fn(inst):
        a, b = inst
        ma, mb = torch.tanh(mix(a)), torch.tanh(mix(b))   # one group: rows a0, b0, a1, b1, ...
        return (mb * w).sum(0) + (ma * w).sum(0) * 2      # one group reads rows b0, a0, b1, a1, ...

    insts = [(torch.randn(32, 32), torch.randn(32, 32)) for _ in range(6)]
    f = assert_matches_eager(fn, insts, list(mix.parameters()) + [w], core=core, consumer_order=False)
    assert f.stats.groups_reordered >= 1
    limit = execute.ORDER_MIN_ROW_BYTES
    try:
        execute.ORDER_MIN_ROW_BYTES = 1 << 40
        with torch.no_grad():
            g = assert_matches_eager(fn, insts, [], core=core, consumer_order=False)
        assert g.stats.groups_reordered == 0
    finally:
        execute.ORDER_MIN_ROW_BYTES = limit
    # laid out in consumer order (the default) the rows are already where the reader wants them
    f = assert_matches_eager(fn, insts, list(mix.parameters()) + [w], core=core)
    assert f.stats.groups_consumer_ordered >= 1 and f.stats.groups_reordered == 0


@pytest.mark.parametrize("core", CORES)
def test_random_factories_inside_a_static_block_draw_per_instance(core):
    # torch.rand(8) in a block has no per-instance argument: it ran once per group and every
    # instance got the same draw (hostile helper, stop 32; present before). Now one draw per node,
    # repeatable with the seed, as outside blocks.
    lin = torch.nn.Linear(8, 8)

    @static_block
    def noisy(x):
        return (lin(x) * torch.rand(8) + torch.randn(2, 4).reshape(8)
                + torch.bernoulli(torch.full((8,), 0.5)) + torch.multinomial(torch.ones(8), 1).float())

    xs = [torch.ones(8) for _ in range(6)]
    f = autobatch(noisy, core=core)
    with torch.no_grad():
        torch.manual_seed(5)
        a = f(xs)
        torch.manual_seed(5)
        b = f(xs)
    assert len({tuple(o.tolist()) for o in a}) == len(xs)  # no two instances share a draw
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert f.stats.fallbacks == 0


@pytest.mark.parametrize("core", CORES)
def test_a_leaf_groups_unread_argument_is_not_gathered(core, monkeypatch):
    # a TreeLSTM-like cell whose leaves never read their second argument (the forget-gate input):
    # the leaf group's program does not refer to it, so it is passed as None, not gathered; the
    # internal nodes (which read it) gather it, and every value equals eager's
    from batchcraft.autobatching import execute, lower

    torch.manual_seed(3)
    proj = static_block(torch.nn.Linear(4, 6))

    @static_block
    def cell(a, f, kids):
        if kids:
            return torch.tanh(a + f * torch.stack(kids, dim=-2).sum(-2))
        return torch.sigmoid(a)

    def tree(t):
        kids = [tree(k) for k in t[1]]
        a = proj(t[0])
        return cell(a, a * 0.5, kids)

    def leaf():
        return (torch.randn(4), [])

    trees = [(torch.randn(4), [leaf(), (torch.randn(4), [leaf(), leaf()])]), leaf(), (torch.randn(4), [leaf()])]
    skipped = []
    real = execute.take_all
    monkeypatch.setattr(execute, "take_all", lambda bufs, plans, defer=(), refs=(), skip=():
                        skipped.append(tuple(sorted(skip))) or real(bufs, plans, defer, refs, skip))
    with torch.no_grad():
        assert_matches_eager(tree, trees, [], core=core)
    assert (1,) in skipped  # the leaves' group: argument 1 (f) never read
    assert () in skipped    # the other groups read all of theirs
    assert lower._unread_inputs(type("P", (), {"steps": [], "out_refs": [("in", 1)], "n_in": 3})()) == {0, 2}
