"""Per-step chains of a recurrent cell block run as one recurrent-layer call (autobatching/chains.py).

Each test checks values (and, where autograd is on, gradients) against eager, and whether the
chains were fused: they must be exactly when the recording proves it equivalent (every non-final
``c`` dead, states and inputs ready before the first step, no branching), never otherwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import batchcraft
from batchcraft import autobatch
from batchcraft.autobatching import _native, chains, static_block
from equivalence import CORES, assert_matches_eager

needs_c = pytest.mark.skipif(not _native.available, reason="the C core was not built")


def _fused(f) -> int:
    return sum(v for k, v in f.stats.groups_by_rule.items() if k.startswith("fused_"))


def _seqs(lengths, dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) for n in lengths]


LENGTHS = (4, 9, 1, 6, 9, 3, 7, 2)


@needs_c
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_cell_block_over_sequences_is_one_layer_call_with_eager_values_and_gradients(kind, bias):
    torch.manual_seed(0)
    if kind == "lstm":
        cell = nn.LSTMCell(6, 5, bias=bias)
    elif kind == "gru":
        cell = nn.GRUCell(6, 5, bias=bias)
    else:
        cell = nn.RNNCell(6, 5, bias=bias, nonlinearity=kind[4:])
    step = static_block(cell)
    w = torch.nn.Parameter(torch.randn(6))

    def rnn(xs):
        h = torch.zeros(5)
        c = torch.zeros(5)
        hs = []
        for x in xs:
            if kind == "lstm":
                h, c = step(x * w, (h, c))
            else:
                h = step(x * w, h)
            hs.append(h)
        return torch.stack(hs), (c if kind == "lstm" else h)

    f = assert_matches_eager(rnn, _seqs(LENGTHS), list(cell.parameters()) + [w], atol=1e-5)
    assert f.stats.groups_by_rule.get(f"fused_{kind}") == 1 and f.stats.fallbacks == 0
    with torch.no_grad():
        g = assert_matches_eager(rnn, _seqs(LENGTHS, seed=1), [])
    assert g.stats.groups_by_rule.get(f"fused_{kind}") == 1


def _lstm_model():
    torch.manual_seed(1)
    cell = nn.LSTMCell(6, 5)
    return cell, static_block(cell)


@needs_c
def test_a_cell_state_kept_by_instance_code_is_not_fused_away():
    cell, step = _lstm_model()

    def rnn(xs):
        h = c = torch.zeros(5)
        cs = []
        for x in xs:
            h, c = step(x, (h, c))
            cs.append(c)  # every step's c is returned: the layer call could not give them
        return h, torch.stack(cs)

    with torch.no_grad():
        f = assert_matches_eager(rnn, _seqs(LENGTHS), [])
    assert _fused(f) == 0


@needs_c
def test_a_cell_state_read_by_another_operation_is_not_fused_away():
    cell, step = _lstm_model()

    def rnn(xs):
        h = c = torch.zeros(5)
        total = torch.zeros(5)
        for x in xs:
            h, c = step(x, (h, c))
            total = total + torch.tanh(c)
        return h, total

    with torch.no_grad():
        f = assert_matches_eager(rnn, _seqs(LENGTHS), [])
    assert _fused(f) == 0


@needs_c
def test_only_the_last_cell_state_is_read_and_that_is_fused():
    cell, step = _lstm_model()

    def rnn(xs):
        h = c = torch.zeros(5)
        for x in xs:
            h, c = step(x, (h, c))
        return h * 2, c.sum()

    f = assert_matches_eager(rnn, _seqs(LENGTHS), list(cell.parameters()))
    assert f.stats.groups_by_rule.get("fused_lstm") == 1


@needs_c
def test_branching_states_and_fed_back_inputs_keep_the_per_step_groups():
    torch.manual_seed(2)
    cell = nn.GRUCell(5, 5)
    step = static_block(cell)

    def tree(xs):  # one state feeds two cells: not a chain
        h0 = torch.zeros(5)
        a = step(xs[0], h0)
        b = step(xs[1], h0)
        return step(xs[2], a) + step(xs[3], b)

    def feedback(xs):  # the next input is the previous output: not ready before the chain
        h = torch.zeros(5)
        x = xs[0]
        for _ in range(len(xs)):
            h = step(x, h)
            x = torch.tanh(h)
        return h

    seqs = _seqs((4, 4, 4, 5, 6, 4, 7, 4, 4, 5), dim=5)
    for fn in (tree, feedback):
        f = assert_matches_eager(fn, seqs, list(cell.parameters()))
        assert _fused(f) == 0, fn.__name__


@needs_c
def test_chains_split_by_value_waits_continue_from_the_last_state():
    cell, step = _lstm_model()

    def rnn(xs):
        h = c = torch.zeros(5)
        for t, x in enumerate(xs):
            h, c = step(x, (h, c))
            if t % 3 == 2 and float(h.sum()) > 1e6:  # a value wait every third step (never true)
                break
        return h, c

    with torch.no_grad():
        f = assert_matches_eager(rnn, _seqs((10, 7, 12, 3, 9, 11, 8, 6)), [])
    assert _fused(f) >= 1 and f.stats.syncs >= 2


@needs_c
def test_the_initial_state_made_by_another_block_in_the_same_flush():
    torch.manual_seed(3)
    init = static_block(nn.Linear(6, 10))
    cell = nn.LSTMCell(6, 5)
    step = static_block(cell)

    def rnn(xs):
        h, c = init(xs[0]).chunk(2)
        for x in xs:
            h, c = step(x, (h, c))
        return h

    f = assert_matches_eager(rnn, _seqs(LENGTHS), list(cell.parameters()) + list(init.parameters()))
    assert f.stats.groups_by_rule.get("fused_lstm") == 1


@needs_c
def test_the_option_and_the_python_core_keep_the_per_step_groups():
    cell, step = _lstm_model()

    def rnn(xs):
        h = c = torch.zeros(5)
        for x in xs:
            h, c = step(x, (h, c))
        return h

    with torch.no_grad():
        for opts in ({"fuse_recurrences": False}, {"core": "python"}, {"scheduler": "agenda"}):
            f = assert_matches_eager(rnn, _seqs(LENGTHS), [], **opts)
            assert _fused(f) == 0, opts


def test_spec_of_recognises_only_a_plain_cell_step():
    from batchcraft.autobatching.signature import SIGNATURES

    torch.manual_seed(4)
    mod = nn.LSTMCell(3, 2)
    plain = static_block(mod)

    @static_block
    def scaled(x, state):  # an extra operation after the cell: not a plain step
        h, c = torch.lstm_cell(x.unsqueeze(0), (state[0].unsqueeze(0), state[1].unsqueeze(0)),
                               mod.weight_ih, mod.weight_hh)
        return h.squeeze(0) * 2, c.squeeze(0)

    def fn(x):
        s = (torch.zeros(2), torch.zeros(2))
        return plain(x, s)[0], scaled(x, s)[0]

    with torch.no_grad():
        autobatch(fn)([torch.randn(3) for _ in range(3)])
    progs = {info.func: info.program for info in SIGNATURES.by_sid if info is not None and info.program is not None}
    assert chains.spec_of(progs[scaled]) is None
    s = chains.spec_of(progs[mod.__dict__["_batchcraft_block"]])
    assert s is not None and s.kind == "lstm" and (s.x, s.states) == (0, (1, 2)) and s.has_biases


@needs_c
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=9),
       keep=st.sampled_from(["none", "last", "all", "some"]), wait_every=st.sampled_from([0, 2, 5]),
       grad=st.booleans())
def test_random_chains_match_eager(lengths, keep, wait_every, grad):
    torch.manual_seed(len(lengths))
    cell = nn.LSTMCell(4, 3)
    step = static_block(cell)

    def rnn(xs):
        h = c = torch.zeros(3)
        kept = []
        for t, x in enumerate(xs):
            h, c = step(x, (h, c))
            if keep == "all" or (keep == "some" and t % 2):
                kept.append(c)
            if wait_every and t % wait_every == wait_every - 1 and float(h.sum()) > 1e6:
                break
        if keep == "last":
            kept.append(c)
        return h, kept

    seqs = _seqs(lengths, dim=4, seed=sum(lengths))
    if grad:
        f = assert_matches_eager(rnn, seqs, list(cell.parameters()))
    else:
        with torch.no_grad():
            f = assert_matches_eager(rnn, seqs, [])
    if keep in ("all", "some") and any(n > 1 + (keep == "some") for n in lengths):
        assert _fused(f) == 0 or wait_every  # (a wait can leave single-step flushes: nothing to refuse)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("block", [True, False])
def test_iterating_sequences_of_many_distinct_lengths(core, block):
    # new-user helper (stop 30, reliability #69): `for x in emb(ids)` makes one source buffer per
    # instance and step; the C planner refused a gather from more than 256 ("too many sources")
    torch.manual_seed(5)
    emb = nn.Embedding(50, 4)
    cell = nn.LSTMCell(4, 3)
    step = static_block(nn.LSTMCell(4, 3)) if block else cell

    def rnn(ids):
        h = c = torch.zeros(3)
        hs = []
        for x in emb(ids):
            h, c = step(x, (h, c))
            hs.append(h)
        return torch.stack(hs)

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in range(3, 40)]  # 37 lengths, 777 steps
    with torch.no_grad():
        f = assert_matches_eager(rnn, seqs, [], core=core)
    assert (_fused(f) == 1) == (block and core == "c")


def test_a_cell_block_that_is_not_packed_says_why():
    # new-user find (stop 35): a static_block(nn.GRUCell) on (1, H) rows ran step by step with no
    # word of why; (H,) rows pack into one layer call
    from batchcraft.autobatching.chains import UNPACKED_FORM

    torch.manual_seed(0)
    H = 8
    results = {}
    for shape in ((H,), (1, H)):
        cell = static_block(torch.nn.GRUCell(H, H))

        def fn(xs, shape=shape, cell=cell):
            h = torch.zeros(shape)
            for x in xs:
                h = cell(x, h)
            return h

        inst = [[torch.randn(shape) for _ in range(5)] for _ in range(8)]
        f = autobatch(fn, core="c") if "c" in CORES else None
        if f is None:
            pytest.skip("the C core packs recurrences")
        with torch.no_grad():
            out = f(inst)
        for o, xs in zip(out, inst):
            torch.testing.assert_close(o, fn(xs))
        results[shape] = (f.stats.groups_by_rule, f.stats.recurrences_unpacked, f.stats.summary())
    assert results[(H,)][0].get("fused_gru") and not results[(H,)][1]
    assert results[(1, H)][1] == {UNPACKED_FORM: 40} and "step by step" in results[(1, H)][2]


@pytest.mark.skipif(not _native.available, reason="fused recurrences need the C core")
def test_a_cell_block_stepped_between_value_requests_says_why_it_is_not_packed():
    # new-user pass, stop 36: recurrences_unpacked was empty for a break on the state
    import random

    from batchcraft.autobatching.chains import UNPACKED_WAITS

    random.seed(0)
    torch.manual_seed(0)
    emb, cell, score = nn.Embedding(50, 8), static_block(nn.GRUCell(8, 8)), nn.Linear(8, 1)

    def f(toks):
        h = torch.zeros(8)
        for t in toks:
            h = cell(emb(torch.tensor(t)), h)
            if torch.sigmoid(score(h)).item() > 0.99:
                break
        return h

    data = [[random.randrange(50) for _ in range(random.randint(3, 12))] for _ in range(20)]
    g = autobatch(f)
    with torch.no_grad():
        for o, d in zip(g(data), data):
            torch.testing.assert_close(o, f(d))
    assert UNPACKED_WAITS in g.stats.recurrences_unpacked


@pytest.mark.skipif(not _native.available, reason="fused recurrences need the C core")
@pytest.mark.parametrize("waits", [False, True])
def test_a_bare_cell_says_to_wrap_it_in_a_static_block(waits):
    # new-user pass, stop 39: a bare GRUCell over a sequence was told about (1, H) rows although its
    # rows were (H,); with a value wait at every step nothing was said at all
    import random

    from batchcraft.autobatching.chains import UNPACKED_BARE

    random.seed(1)
    torch.manual_seed(1)
    emb, cell, score = nn.Embedding(50, 8), nn.GRUCell(8, 8), nn.Linear(8, 1)

    def f(toks):
        h = torch.zeros(8)
        for t in toks:
            h = cell(emb(torch.tensor(t)), h)
            if waits and torch.sigmoid(score(h)).item() > 0.99:
                break
        return h

    data = [[random.randrange(50) for _ in range(random.randint(3, 12))] for _ in range(20)]
    g = autobatch(f)
    with torch.no_grad():
        g(data)
        for o, d in zip(g(data), data):
            torch.testing.assert_close(o, f(d))
    assert UNPACKED_BARE in g.stats.recurrences_unpacked, g.stats.recurrences_unpacked


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap"])
def test_cell_chains_under_a_transform_run_step_by_step_and_match_eager(core, transform):
    # hostile helper, stop 40 (present before): a chain packed into one nn.GRU call raised under
    # torch.func (no storage behind grad/jvp wrappers, no batching rule for aten::gru.data under
    # vmap); under a transform the chains now run as per-step groups
    torch.manual_seed(0)
    cell = static_block(nn.GRUCell(4, 4))

    def fn(seq):
        h = torch.zeros(4)
        for x in seq:
            h = cell(x, h)
        return h

    X, T = torch.randn(3, 5, 4), torch.randn(3, 5, 4)

    def insts(Xs):
        return [list(s.unbind(0)) for s in Xs.unbind(0)]

    def run(g):
        if transform == "grad":
            return torch.func.grad(lambda Xs: sum(o.sum() for o in g(insts(Xs))))(X)
        if transform == "jvp":
            return torch.func.jvp(lambda Xs: torch.stack(g(insts(Xs))), (X,), (T,))[1]
        return torch.func.vmap(lambda Xs: torch.stack(g(insts(Xs))))(torch.stack([X, T]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (functorch: no batching rule for gru_cell, a slow path)
        torch.testing.assert_close(run(autobatch(fn, core=core)), run(lambda xs: [fn(x) for x in xs]),
                                   atol=1e-5, rtol=1e-5)


# -- readers of fused chains re-levelled (chains.relevel) ----------------------------------------------

def _tagger(phased=False):
    torch.manual_seed(3)
    fwd, bwd = nn.LSTMCell(6, 5), nn.LSTMCell(6, 5)
    out = nn.Linear(10, 3)
    f_step, b_step, o_step = static_block(fwd), static_block(bwd), static_block(out)

    def tag(xs):  # a BiLSTM tagger: every word's output reads both directions' states
        h = c = torch.zeros(5)
        fw = []
        for x in xs:
            h, c = f_step(x, (h, c))
            fw.append(h)
        h = c = torch.zeros(5)
        bw = [None] * len(xs)
        for t in range(len(xs) - 1, -1, -1):
            h, c = b_step(xs[t], (h, c))
            bw[t] = h
        if phased:
            batchcraft.phase("classify")
        return torch.stack([o_step(torch.cat([f, b])) for f, b in zip(fw, bw)])

    return tag, [*fwd.parameters(), *bwd.parameters(), *out.parameters()]


@needs_c
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("phased", [False, True])
def test_the_readers_of_fused_recurrences_run_as_one_group_per_signature(grad, phased):
    tag, params = _tagger(phased)
    # (under autograd a first step, whose zero state needs no gradient, is a signature of its own:
    # one more block group per direction; no sentence of one word, whose output would then be
    # ready a step earlier than the others')
    lengths = (4, 9, 2, 6, 9, 3, 7, 2)
    with torch.set_grad_enabled(grad):
        f = assert_matches_eager(tag, [list(x) for x in _seqs(lengths)], params if grad else [])
    by_rule = f.stats.groups_by_rule
    assert by_rule.get("fused_lstm") == 2
    # per word one output block and one cat, recorded at the depths of the steps they read (up to
    # 9 each without re-levelling): one group each; the final stacks group by length
    assert by_rule.get("block") == 1 + 2 * grad
    assert by_rule.get("seq") == 1 + len(set(lengths))
    assert (f.stats.groups_merged > 0) != phased  # (in a phase of their own they were one group anyway)
    assert f.stats.recurrences_stepwise == 2 * (not grad)


@needs_c
def test_relevel_declines_a_node_in_two_items_and_an_item_read_before_its_producer(monkeypatch):
    seen = []
    real = chains.relevel

    def checked(rec, schedule):
        items = [it[2] if it[0] == "group" else [nd for c in it[1].chains for nd in c] for it in schedule]
        seen.append((rec.relevel(items + [items[-1][:1]]), rec.relevel(items[::-1])))
        with pytest.raises(ValueError, match="out of range"):
            rec.relevel([[rec.n_nodes + 5]])
        return real(rec, schedule)

    monkeypatch.setattr(chains, "relevel", checked)
    tag, _ = _tagger()
    with torch.no_grad():
        f = assert_matches_eager(tag, _seqs(LENGTHS), [])
    assert seen == [(None, None)] and f.stats.groups_by_rule.get("block") == 1


def test_relevel_keeps_the_schedule_when_the_recorder_declines():
    class Declines:
        def relevel(self, items):
            return None

    schedule = [("group", (0, 1, 7), [1, 2]), ("group", (0, 2, 7), [3])]
    assert chains.relevel(Declines(), schedule) == (schedule, [((0, 1, 7), [1, 2]), ((0, 2, 7), [3])])


def test_relevel_merges_groups_of_one_signature_at_one_new_depth_and_orders_by_phase():
    class Levels:
        def relevel(self, items):
            return [1, 2, 1, 2, 1]

    unit = chains.Chains(None, None, [[10, 11]], phase=0)
    schedule = [("group", (0, 1, 7), [1]), ("group", (0, 2, 8), [2]), ("chains", unit),
                ("group", (0, 3, 8), [3]), ("group", (1, 1, 8), [4])]
    got, groups = chains.relevel(Levels(), schedule)
    assert got == [("group", (0, 1, 7), [1]), ("chains", unit), ("group", (0, 2, 8), [2, 3]),
                   ("group", (1, 1, 8), [4])]
    assert groups == [((0, 1, 7), [1]), ((0, 2, 8), [2, 3]), ((1, 1, 8), [4])]


# -- inference steps without the layer call (chains.stepwise) -------------------------------------------

def _spec(kind, bias, dim, hidden, seed):
    torch.manual_seed(seed)
    cell = nn.LSTMCell(dim, hidden, bias=bias) if kind == "lstm" else nn.GRUCell(dim, hidden, bias=bias)
    layer = {"lstm": torch._VF.lstm, "gru": torch._VF.gru}[kind]
    params = [cell.weight_ih, cell.weight_hh] + ([cell.bias_ih, cell.bias_hh] if bias else [])
    return chains.ChainSpec(kind, 2 if kind == "lstm" else 1, layer, 0, (1, 2)[:2 if kind == "lstm" else 1],
                            params, bias)


def _packed_inputs(lengths, dim, hidden, n_states, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = sorted(lengths, reverse=True)
    sizes = [sum(1 for n in lengths if n > t) for t in range(lengths[0])]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    last = [offsets[n - 1] + j for j, n in enumerate(lengths)]
    x = torch.randn(sum(lengths), dim, generator=g)
    states = [torch.randn(len(lengths), hidden, generator=g) for _ in range(n_states)]
    return x, states, sizes, last


@pytest.mark.skipif(not _native.available, reason="needs the C extensions")
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["lstm", "gru"]), bias=st.booleans(),
       lengths=st.lists(st.integers(1, 9), min_size=1, max_size=12),
       dim=st.integers(1, 20), hidden=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_stepwise_gives_the_layer_calls_values(kind, bias, lengths, dim, hidden, seed):
    spec = _spec(kind, bias, dim, hidden, seed)
    x, states, sizes, last = _packed_inputs(lengths, dim, hidden, spec.n_states, seed)
    with torch.no_grad():
        got = chains.stepwise(spec, x, states, sizes)
        ref, layer_stepwise = chains.run(spec, x, states, sizes, last)
        via_run, run_stepwise = chains.run(spec, x, states, sizes, last, fused=True)
    assert got is not None and run_stepwise and not layer_stepwise
    assert all(torch.equal(a, b) for a, b in zip(via_run, got))
    torch.testing.assert_close(got[0], ref[0], atol=2e-6, rtol=1e-5)
    if kind == "lstm":  # only the last c of each chain is the layer's output
        torch.testing.assert_close(got[1][last], ref[1][last], atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not _native.available, reason="needs the C extensions")
def test_stepwise_declines_autograd_autocast_and_other_dtypes():
    spec = _spec("lstm", True, 4, 3, 0)
    x, states, sizes, last = _packed_inputs([3, 1, 2], 4, 3, 2, 0)
    assert chains.stepwise(spec, x, states, sizes) is None  # the weights require grad
    with torch.no_grad():
        assert chains.stepwise(spec, x, states, sizes) is not None
        assert chains.stepwise(spec, x.double(), [s.double() for s in states], sizes) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert chains.stepwise(spec, x, states, sizes) is None
        with torch.autograd.forward_ad.dual_level():
            assert chains.stepwise(spec, x, states, sizes) is None
    with torch.inference_mode():
        assert chains.stepwise(spec, x, states, sizes) is not None


@pytest.mark.skipif(not _native.available, reason="needs the C extensions")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("layout", ["shared_row", "column_major", "negative_view", "sliced"])
def test_stepwise_reads_initial_states_of_any_layout(kind, layout):
    spec = _spec(kind, True, 4, 3, 1)
    x, states, sizes, last = _packed_inputs([3, 5, 2, 5], 4, 3, spec.n_states, 1)
    if layout == "shared_row":
        states = [s[:1].expand(4, 3) for s in states]
    elif layout == "column_major":
        states = [s.t().contiguous().t() for s in states]
    elif layout == "negative_view":
        states = [torch._neg_view(s) for s in states]
    else:
        states = [torch.randn(4, 7)[:, 2:5] for _ in states]
    with torch.no_grad():
        got = chains.stepwise(spec, x, states, sizes)
        ref, _ = chains.run(spec, x, [s.clone() for s in states], sizes, last)
    torch.testing.assert_close(got[0], ref[0], atol=2e-6, rtol=1e-5)
    if kind == "lstm":
        torch.testing.assert_close(got[1][last], ref[1][last], atol=2e-6, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_batch_in_inference_runs_its_chains_stepwise_and_training_through_the_layer(kind, monkeypatch):
    used = []
    real = chains.stepwise
    monkeypatch.setattr(chains, "stepwise", lambda *a, **k: used.append(real(*a, **k) is not None) or real(*a, **k))
    torch.manual_seed(0)
    cell = nn.LSTMCell(6, 5) if kind == "lstm" else nn.GRUCell(6, 5)
    step = static_block(cell)

    def rnn(xs):
        h = c = torch.zeros(5)
        hs = []
        for x in xs:
            if kind == "lstm":
                h, c = step(x, (h, c))
            else:
                h = step(x, h)
            hs.append(h)
        return torch.stack(hs)

    with torch.no_grad():
        assert_matches_eager(rnn, _seqs(LENGTHS), [])
    assert used == [True]
    used.clear()
    assert_matches_eager(rnn, _seqs(LENGTHS), list(cell.parameters()))
    assert used == [False]  # asked, declined: the layer call carries the gradients
    used.clear()
    with torch.no_grad():
        assert_matches_eager(rnn, _seqs(LENGTHS), [], fuse_elementwise=False)
    assert used == []


@needs_c
@pytest.mark.parametrize("grad", [False, True])
def test_a_recurrence_over_another_recurrences_outputs_is_fused_too(grad):
    torch.manual_seed(0)
    l1, l2 = nn.LSTMCell(6, 5), nn.GRUCell(5, 4)
    s1, s2 = static_block(l1), static_block(l2)

    def stacked(xs):  # the second layer's inputs are the first's per-step outputs
        h = c = torch.zeros(5)
        hs = []
        for x in xs:
            h, c = s1(x, (h, c))
            hs.append(torch.tanh(h))
        g = torch.zeros(4)
        outs = []
        for v in hs:
            g = s2(v, g)
            outs.append(g)
        return torch.stack(outs)

    with torch.set_grad_enabled(grad):
        f = assert_matches_eager(stacked, [list(x) for x in _seqs((4, 9, 2, 6, 9, 3, 7, 2))],
                                 [*l1.parameters(), *l2.parameters()] if grad else [])
    by_rule = f.stats.groups_by_rule
    assert by_rule.get("fused_lstm") == 1 and by_rule.get("fused_gru") == 1
    assert by_rule.get("elementwise") == 1 + grad  # the tanh of every step: one group (grad: + first steps')
    assert f.stats.recurrences_unpacked == {}  # the first pass's "inputs computed after the first step" is not kept
