"""The runtime end to end: equivalence with eager on real and random trees, edge cases, stats."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch, static_block
from batchcraft.errors import InstanceError, UnsupportedOperationError
from batchcraft.models.treelstm import TreeLSTM

from equivalence import CORES, assert_matches_eager, make_tree, random_tree


@pytest.fixture
def treelstm():
    torch.manual_seed(0)
    return TreeLSTM(vocab_size=400, hidden=24, word_dim=16, tag_dim=8)


def test_treelstm_real_ud_trees_values_and_gradients(treelstm, ud_sentences):
    m = TreeLSTM(vocab_size=max(max(s.word_ids) for s in ud_sentences) + 1, hidden=24, word_dim=16, tag_dim=8)
    f = assert_matches_eager(m, ud_sentences[:40], list(m.parameters()))
    assert f.stats.batched_calls < f.stats.ops_recorded / 5  # it really batched
    assert f.stats.fallbacks == 0


@pytest.mark.parametrize("scheduler", ["depth", "agenda"])
def test_treelstm_random_trees(treelstm, scheduler):
    trees = [random_tree(n, seed=n) for n in (1, 2, 3, 5, 8, 13, 21, 34)]
    assert_matches_eager(treelstm, trees, list(treelstm.parameters()), scheduler=scheduler)


def test_single_node_deep_chain_and_wide_fanout(treelstm):
    single = make_tree([-1])
    chain = make_tree([-1] + list(range(0, 59)))  # depth 60
    fan = make_tree([-1] + [0] * 40)  # one node with 40 children
    assert_matches_eager(treelstm, [single, chain, fan], list(treelstm.parameters()))


def test_batch_of_one_and_empty_input(treelstm):
    assert_matches_eager(treelstm, [random_tree(7, 3)], list(treelstm.parameters()))
    f = autobatch(treelstm)
    assert f([]) == []
    assert f.stats.instances == 0 and f.stats.batched_calls == 0


def test_instances_in_scrambled_order_read_their_own_rows(treelstm):
    # operands of a group come from different earlier groups in scrambled order (DyNet #1258)
    trees = [random_tree(n, seed=100 + n) for n in (9, 2, 17, 1, 6, 30, 4)]
    f = autobatch(treelstm)
    with torch.no_grad():
        out = f(trees)
        out_rev = f(trees[::-1])
    for a, b in zip(out, out_rev[::-1]):
        torch.testing.assert_close(a, b)


def test_nested_container_outputs():
    lin = nn.Linear(4, 3)

    def fn(x):
        h = lin(x)
        return {"h": h, "pair": (h.sum(), [torch.relu(h), x * 2]), "n": 7}

    xs = [torch.randn(4) for _ in range(5)]
    out = autobatch(fn)(xs)
    for o, x in zip(out, xs):
        r = fn(x)
        assert set(o) == {"h", "pair", "n"} and o["n"] == 7
        torch.testing.assert_close(o["pair"][1][0], r["pair"][1][0])
        torch.testing.assert_close(o["pair"][0], r["pair"][0])
        assert isinstance(o["pair"], tuple) and isinstance(o["pair"][1], list)
        assert type(o["h"]) is torch.Tensor


def test_loops_of_instance_dependent_length_batch_across_instances():
    cell = nn.GRUCell(6, 10)
    proj = nn.Linear(10, 2)

    def fn(seq):  # seq: (length, 6)
        h = torch.zeros(10)
        for t in range(seq.shape[0]):
            h = cell(seq[t], h)
        return proj(h)

    seqs = [torch.randn(n, 6) for n in (1, 4, 9, 4, 2, 7)]
    f = assert_matches_eager(fn, seqs, list(cell.parameters()) + list(proj.parameters()))
    assert f.stats.fallbacks == 0


def test_embedding_of_created_scalar_tensors_is_one_batched_lookup():
    emb = nn.Embedding(100, 8)
    f = autobatch(lambda ids: torch.stack([emb(torch.tensor(i)) for i in ids]).sum(0))
    insts = [[1, 5, 7], [2, 2, 9], [40, 3, 3]]
    out = f(insts)
    for o, ids in zip(out, insts):
        torch.testing.assert_close(o, emb(torch.tensor(ids)).sum(0))
    # 9 lookups recorded, run as one batched call
    assert f.stats.groups_by_rule.get("weight") == 1


def test_fallback_counted_for_operation_without_batching_rule():
    @torch.library.custom_op("batchcraft_test::scale_shift", mutates_args=())
    def scale_shift(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    @scale_shift.register_fake
    def _(x):
        return torch.empty_like(x)

    scale_shift.register_autograd(lambda ctx, g: g * 2)

    lin = nn.Linear(3, 3)
    fn = lambda x: lin(scale_shift(lin(x)))  # noqa: E731
    f = assert_matches_eager(fn, [torch.randn(3) for _ in range(6)], list(lin.parameters()))
    assert f.stats.fallbacks == 6
    assert f.stats.groups_by_rule["fallback"] == 1


def test_value_dependent_output_shape_runs_eagerly_and_is_counted():
    def fn(x):
        return torch.nonzero(x > 0).sum() + x.sum()

    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -1.0, 0.5])]
    f = autobatch(fn)
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, fn(x))
    assert f.stats.eager_ops == 2


def test_in_place_operations_match_eager():
    def fn(x):
        y = x * 2
        y.add_(1)
        y[0] = 5.0
        y[y > 6] = 0.0
        y.clamp_(min=-1)
        return y

    xs = [torch.randn(3) * 4, torch.randn(3) * 4]
    out = autobatch(fn)(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, fn(x))


def test_exception_in_one_instance_names_it():
    def fn(x):
        if x.shape[0] == 3:
            raise ValueError("bad instance")
        return x * 2

    with pytest.raises(InstanceError) as ei:
        autobatch(fn)([torch.randn(2), torch.randn(2), torch.randn(3)])
    assert ei.value.instance == 2 and "bad instance" in str(ei.value)


def test_stats_are_public_and_consistent(treelstm):
    f = autobatch(treelstm)
    trees = [random_tree(n, seed=n) for n in (3, 4, 5, 6)]
    with torch.no_grad():
        f(trees)
    st = f.stats
    assert st.instances == 4
    assert st.ops_recorded == 2 * sum(len(t) for t in trees)  # two static blocks per node
    assert 0 < st.batched_calls < st.ops_recorded
    assert st.record_s > 0 and st.kernel_s > 0
    assert "batched calls" in st.summary() and st.to_dict()["mean_batch"] == st.mean_batch


def test_static_block_function_and_results_outside_autobatch():
    w = torch.randn(5, 5, requires_grad=True)

    @static_block
    def block(x, y):
        return torch.tanh(x @ w + y), (x * y).sum()

    xs = [(torch.randn(5), torch.randn(5)) for _ in range(4)]
    a, b = block(*xs[0])  # outside autobatch it is a plain call
    assert a.shape == (5,)
    assert_matches_eager(lambda p: block(*p), xs, [w])


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="scheduler"):
        autobatch(lambda x: x, scheduler="fastest")
    with pytest.raises(ValueError, match="max_steps"):
        autobatch(lambda x: x, max_steps=0)
    with pytest.raises(TypeError):
        autobatch(42)


@pytest.mark.parametrize("core", CORES)
def test_iterating_a_per_instance_tensor_is_one_unbind_and_rows_stay_views(core):
    # found by a new-user trial: `for x in seq` made one getitem per row, and sequences of
    # different lengths could not share them (a group per (length, row)); torch iterates by unbind
    blk = static_block(torch.nn.Linear(4, 4))

    def rnn(seq):
        h = torch.zeros(4)
        for x in seq:
            h = torch.tanh(blk(x) + h)
        return h

    def bump(x):
        y = x * 1
        for row in y:
            row.add_(1)  # through the view: y changes, as in eager
        return y

    seqs = [torch.randn(n, 4) for n in (3, 5, 2, 5)]
    f = autobatch(rnn, core=core)
    with torch.no_grad():
        out = f(seqs)
        for o, s in zip(out, seqs):
            torch.testing.assert_close(o, rnn(s))
    assert "getitem" not in f.stats.groups_by_rule
    for o, x in zip(autobatch(bump, core=core)(seqs), seqs):
        torch.testing.assert_close(o, bump(x))


@pytest.mark.parametrize("core", CORES)
def test_a_block_called_with_a_state_tuple_records_on_the_fast_path(core, monkeypatch):
    # BiRNN's `cell(x, (h, c))`: the C core took every such call to the Python slow path
    # (~50 us each, 4x the recording time of the whole tagger); now only new signatures do
    from batchcraft.autobatching.blocks import StaticBlock

    torch.manual_seed(3)
    cell = static_block(torch.nn.LSTMCell(4, 5))
    slow = []
    original = StaticBlock._record_slow
    monkeypatch.setattr(StaticBlock, "_record_slow", lambda self, *a: slow.append(1) or original(self, *a))

    def rnn(seq):
        h = c = torch.zeros(5)
        hs = []
        for x in seq:
            h, c = cell(x, (h, c))
            hs.append(h)
        return torch.stack(hs)

    seqs = [torch.randn(n, 4) for n in (3, 7, 1, 5)]
    f = assert_matches_eager(rnn, seqs, list(cell.parameters()), core=core)
    steps = sum(len(s) for s in seqs)
    slow.clear()
    f(seqs)
    assert f.stats.fallbacks == 0
    if core == "c":  # the first step (zeros: plain tensors in the tuple) and nothing else
        assert len(slow) <= len(seqs), (len(slow), steps)
    else:
        assert len(slow) == steps


@pytest.mark.parametrize("order", [("no_grad", "inference"), ("inference", "no_grad", "grad")])
def test_calls_under_inference_mode_record_on_the_fast_path(treelstm, order, monkeypatch):
    # under torch.inference_mode() the C core sent every block call and operation to the Python
    # slow path (a TreeLSTM batch 3.2x slower than under no_grad); the mode is now part of each
    # key, so a signature inferred under one state is never reused under another
    from batchcraft.autobatching import _native, recorder
    from batchcraft.autobatching.blocks import StaticBlock

    if _native.core is None:
        pytest.skip("the C core was not built")
    slow = []
    original, general = StaticBlock._record_slow, recorder.RecorderBase.general
    monkeypatch.setattr(StaticBlock, "_record_slow", lambda self, *a: slow.append(1) or original(self, *a))
    monkeypatch.setattr(recorder.RecorderBase, "general",
                        lambda self, *a: slow.append(getattr(a[0], "__name__", a[0])) or general(self, *a))

    def fn(tree):  # blocks and ordinary operations on their outputs
        h = treelstm(tree)
        return torch.tanh(h) * 2 + h.sum()

    ctxs = {"no_grad": torch.no_grad, "inference": torch.inference_mode, "grad": torch.enable_grad}
    trees = [random_tree(n, seed=n) for n in (1, 3, 6, 10)]
    f = autobatch(fn, core="c")
    for name in order:
        with ctxs[name]():
            f(trees)  # (signatures inferred)
            slow.clear()
            out = f(trees)
            assert [c for c in slow if c != "_set_grad_enabled"] == [], (name, slow)  # (the call's set-up)
            for o, t in zip(out, trees):
                r = fn(t)
                assert o.is_inference() == r.is_inference() and o.requires_grad == r.requires_grad, name
                torch.testing.assert_close(o, r)


def test_calls_under_autocast_record_on_the_fast_path_and_keep_each_dtype(monkeypatch):
    # under torch.autocast the C core sent every block call and operation to the Python slow path
    # (a TreeLSTM batch 1.9x slower); now the devices on and their dtypes are part of each key:
    # a signature inferred under bfloat16 is never reused under float16, nor under autocast off
    from batchcraft.autobatching import _native, recorder
    from batchcraft.autobatching.blocks import StaticBlock

    if _native.core is None or not _native.core.state_readers_on()[1]:
        pytest.skip("no C core or no autocast reader here")
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    cell = static_block(nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
    slow = []
    original, general = StaticBlock._record_slow, recorder.RecorderBase.general
    monkeypatch.setattr(StaticBlock, "_record_slow", lambda self, *a: slow.append(1) or original(self, *a))
    monkeypatch.setattr(recorder.RecorderBase, "general",
                        lambda self, *a: slow.append(getattr(a[0], "__name__", a[0])) or general(self, *a))

    def fn(x):
        h = cell(lin(x))
        with torch.autocast("cpu", enabled=False):  # off inside instance code: its own key
            k = lin(h.float())
        return h, k, cell(h) * 2

    xs = [torch.randn(6) for _ in range(5)]
    f = autobatch(fn, core="c")
    states = [torch.bfloat16, torch.float16, None, torch.bfloat16]
    for dtype in states:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
        with torch.no_grad(), ctx:
            f(xs)  # (signatures inferred)
            slow.clear()
            out = f(xs)
            assert [c for c in slow if c != "_set_grad_enabled"] == [], (dtype, slow)
            for o, x in zip(out, xs):
                for a, b in zip(o, fn(x)):
                    assert a.dtype == b.dtype, dtype
                    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("core", CORES)
def test_zeros_and_ones_of_int_sizes_are_leaves_like_eager(core, monkeypatch):
    # the constant leaf (recorder.const_leaf, consts.py) skips the general path: dtypes under the
    # instance's default dtype, in-place updates of the leaf, gradients through it, as eager
    from batchcraft.autobatching import recorder

    general_calls = []
    real = recorder.RecorderBase.general
    monkeypatch.setattr(recorder.RecorderBase, "general",
                        lambda self, f, *a: general_calls.append(getattr(f, "__name__", f)) or real(self, f, *a))
    w = torch.randn(3, requires_grad=True)

    def fn(inst):
        x, wide = inst
        if wide:
            torch.set_default_dtype(torch.float64)
        z = torch.zeros(3)
        o = torch.ones(2, 3)
        z.add_(x * w)   # in place on the leaf
        torch.set_default_dtype(torch.float32)
        return z + o.sum(0).to(z.dtype), torch.zeros(len(x) - 3 + 1, 2).shape[0]

    xs = [(torch.randn(3), i % 2 == 1) for i in range(5)]
    f = assert_matches_eager(fn, xs, [w], core=core)
    assert not {"zeros", "ones"} & set(general_calls)  # every zeros/ones call took the leaf path
    with pytest.raises(InstanceError, match="negative"):
        f([(torch.randn(3), False)] * 2 + [(torch.randn(1), False)])  # torch.zeros(-1, 2): torch's error


@pytest.mark.parametrize("core", CORES)
def test_tensor_instances_become_leaves_without_recording_their_metadata_reads(core, monkeypatch):
    # reading an input's shape/dtype/device/requires_grad under the recording mode went through
    # the general recording path, four calls per instance (15 µs an instance)
    from batchcraft.autobatching import recorder

    f = autobatch(torch.tanh, core=core)
    xs = [torch.randn(3) for _ in range(16)]
    f(xs)
    calls = []
    general = recorder.RecorderBase.general

    def spy(self, func, args, kwargs):
        calls.append(getattr(func, "__name__", func))
        return general(self, func, args, kwargs)

    monkeypatch.setattr(recorder.RecorderBase, "general", spy)
    out = f(xs)
    assert len(calls) <= 2, calls  # (the call's own grad-mode set-up may pass the mode once)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, torch.tanh(x))


@pytest.mark.parametrize("core", CORES)
def test_property_reads_of_shared_tensors_match_eager(core):
    # a model's forward reading ``self.weight.device`` once per instance took the general
    # recording path (2.3 µs an instance); the fast path must answer exactly as eager does
    w = torch.nn.Parameter(torch.randn(3, 4))
    w.grad = torch.ones(3, 4)

    def fn(x):
        facts = (w.device, w.shape, w.dtype, w.requires_grad, w.is_leaf, w.ndim,
                 w.T.data_ptr() == w.data_ptr(), w.data.data_ptr() == w.data_ptr(),
                 w.grad.data_ptr() == w.grad.data_ptr())
        return x @ w.T, facts

    xs = [torch.randn(4) for _ in range(5)]
    out = autobatch(fn, core=core)(xs)
    for (y, facts), x in zip(out, xs):
        ey, efacts = fn(x)
        assert facts == efacts
        torch.testing.assert_close(y, ey)


def test_c_core_answers_property_reads_of_shared_tensors_without_the_general_path(monkeypatch):
    # ``self.weight.device`` in a model's forward (TreeLSTM reads it once per instance) went
    # through the Python general path, 1.8 µs a read; the C mode answers non-tensor properties
    # of plain tensors and Parameters itself (0.9 µs). Tensor-valued ones (.data, .T, .grad)
    # still take the Python path, which keeps them aliasing the shared tensor (as in eager).
    pytest.importorskip("batchcraft.autobatching._core")
    from batchcraft.autobatching import recorder

    w = torch.nn.Parameter(torch.randn(3, 4))
    plain = torch.randn(4)
    names = []
    general = recorder.RecorderBase.general

    def spy(self, func, args, kwargs):
        names.append(getattr(func, "__name__", str(func)))
        return general(self, func, args, kwargs)

    def fn(x):
        for _ in range(10):
            facts = (w.device, w.dtype, w.shape, w.requires_grad, plain.device, plain.is_leaf)
        w.data.mul_(1.0)  # an alias of the shared weight: written through, as in eager
        return x @ w.T, facts

    f = autobatch(fn, core="c")
    xs = [torch.randn(4) for _ in range(6)]
    f(xs)
    monkeypatch.setattr(recorder.RecorderBase, "general", spy)
    out = f(xs)
    assert names.count("__get__") <= 2 * len(xs)  # .data and .T per instance, not the 60 plain reads
    for (y, facts), x in zip(out, xs):
        ey, efacts = fn(x)
        assert facts == efacts
        torch.testing.assert_close(y, ey)


@pytest.mark.parametrize("core", CORES)
def test_tensors_made_from_lists_of_python_scalars_match_eager(core, monkeypatch):
    # the C mode makes torch.tensor(list of ints/floats/bools) a leaf at once (Berxit's token
    # ids: 2.5 ms a batch of 64 went in walking the lists in Python); what it makes is eager's
    from batchcraft.autobatching import recorder

    def fn(x):
        n = int(x.shape[0])
        made = (torch.tensor([1, 2, n]), torch.tensor([0.5, n]), torch.tensor([True, False] * n),
                torch.tensor((n, 2), dtype=torch.float64), torch.tensor([]), torch.tensor([[n, 1], [2, 3]]),
                torch.tensor([n, 2.5, True]), torch.tensor([n], dtype=torch.int32, device="cpu"))
        return [x.sum() + m.to(x.dtype).sum() for m in made], made

    xs = [torch.randn(k) for k in (1, 3, 2, 5)]
    f = autobatch(fn, core=core)
    f(xs)
    names = []
    general = recorder.RecorderBase.general

    def spy(self, func, args, kwargs):
        names.append(func)
        return general(self, func, args, kwargs)

    monkeypatch.setattr(recorder.RecorderBase, "general", spy)
    out = f(xs)
    for (sums, made), x in zip(out, xs):
        esums, emade = fn(x)
        for m, e in zip(made, emade):
            assert m.dtype == e.dtype and m.shape == e.shape and torch.equal(m, e)
        for a, b in zip(sums, esums):
            torch.testing.assert_close(a, b)
    if core == "c":  # only the nested list takes the general path
        assert names.count(torch.tensor) == len(xs), names
    with pytest.raises(InstanceError, match="[Oo]verflow"):
        autobatch(lambda x: torch.tensor([2 ** 70]) + x, core=core)([torch.randn(1)])


class _Tagged(torch.Tensor):
    """A Tensor subclass with torch's default ``__torch_function__`` (results keep the type)."""


class _Logged(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("core", CORES)
def test_captured_tensor_subclass_reads_keep_their_type_as_in_eager(core):
    # reliability #93: .T, .data and .t() of a captured subclass came back as plain Tensors
    tagged = torch.randn(3, 3).as_subclass(_Tagged)
    logged = torch.randn(3, 3).as_subclass(_Logged)
    param = torch.nn.Parameter(torch.randn(3, 3))

    def fn(x):
        outs = (tagged.T, tagged.data, tagged.t(), logged.t(), param.T, param.t())
        return x @ tagged.t(), tuple(type(o).__name__ for o in outs), tagged.t().data_ptr() == tagged.data_ptr()

    xs = [torch.randn(3) for _ in range(3)]
    _Logged.calls.clear()
    ref = [fn(x) for x in xs]
    eager_calls = sorted(_Logged.calls)
    _Logged.calls.clear()
    out = autobatch(fn, core=core)(xs)
    # the subclass's handler ran once per call, as in eager (the recorder's own reads of
    # ``requires_grad`` for its signature keys also reach it, as property ``__get__`` calls)
    assert sorted(c for c in _Logged.calls if c != "__get__") == eager_calls
    for o, r in zip(out, ref):
        assert o[1] == r[1] == ("_Tagged", "_Tagged", "_Tagged", "_Logged", "Tensor", "Tensor")
        assert o[2] and r[2]
        torch.testing.assert_close(o[0].as_subclass(torch.Tensor), r[0].as_subclass(torch.Tensor))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fill_factory_leaves_follow_the_default_dtype_and_stay_per_instance(core, dtype):
    # torch.zeros(int, ...) becomes a leaf without the general path; its descriptor is built from
    # the sizes and the made tensor (dtype, device): the default dtype must reach it, and an
    # in-place update of one instance's zeros must not reach another's
    def fn(x):
        h = torch.zeros(3)
        o = torch.ones(2, 3)
        h.add_(x)
        return h * 2, o.sum(0) + h, h.dtype

    xs = [torch.randn(3, dtype=dtype) for _ in range(4)]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        out = autobatch(fn, core=core)(xs)
        ref = [fn(x) for x in xs]
    finally:
        torch.set_default_dtype(prev)
    for o, r in zip(out, ref):
        assert o[2] == r[2] == dtype and o[0].dtype == r[0].dtype
        torch.testing.assert_close(o[0], r[0])
        torch.testing.assert_close(o[1], r[1])


@pytest.mark.parametrize("core", CORES)
def test_a_captured_subclass_that_is_not_the_first_argument_keeps_its_handler(core):
    # #99 (a gap in #93's fix): torch.add(plain, sub), plain * sub, torch.cat([plain, sub])
    plain, tagged = torch.ones(3), torch.ones(3).as_subclass(_Tagged)

    def fn(x):  # (inside instance code a computed tensor is a lazy value: the outputs are compared)
        return x, torch.add(plain, tagged), plain * tagged, torch.cat([plain, tagged])

    out = autobatch(fn, core=core)([torch.randn(3), torch.randn(3)])
    for o in out:
        assert [type(t) for t in o[1:]] == [type(t) for t in fn(torch.randn(3))[1:]] == [_Tagged] * 3


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fibers", [True, False])
@pytest.mark.parametrize("block", [False, True])
def test_an_error_of_batched_work_has_torchs_error_as_its_cause(core, fibers, block):
    # with fibers=False the InstanceError's __cause__ was None (a helper's find, stop 47)
    def body(x):
        return x[x > 0].max()  # instance 2 selects nothing: max() of an empty tensor raises

    fn = static_block(body) if block else body
    xs = [torch.randn(5).abs() + 0.1, torch.randn(5).abs() + 0.1, -torch.ones(5), torch.randn(5).abs() + 0.1]
    with pytest.raises(RuntimeError) as eager:
        [body(x) for x in xs]
    f = autobatch(lambda x: fn(x) * 2, core=core, fibers=fibers)
    with pytest.raises(InstanceError) as err:
        f(xs)
    assert err.value.instance == 2
    assert type(err.value.__cause__) is type(eager.value) and str(err.value.__cause__) == str(eager.value)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("hoist", [True, False])
def test_a_failure_in_a_hoisted_prefix_names_its_instance(core, hoist):
    # a recurrence over a block whose input projection is hoisted (run once for all its groups):
    # a failing lookup there raised AutobatchError without the instance, and nothing the earlier
    # instances wrote was finished (a helper's find, present before stop 47)
    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.emb = nn.Linear(3, 3), nn.Embedding(5, 3)

        def forward(self, x, idx):
            return torch.tanh(self.lin(x)) + self.emb(idx)

    torch.manual_seed(0)
    cell = static_block(Cell())

    def f(inp):
        x, ids = inp
        x.add_(1)
        for i in ids:
            x = cell(x, torch.tensor(i))
        return x.sum()

    def make():
        return [(torch.zeros(3), [1, 2, 7 if k == 2 else 3]) for k in range(4)]

    eager = make()
    with pytest.raises(IndexError):
        [f(x) for x in eager]
    inst = make()
    with pytest.raises(InstanceError) as info:
        autobatch(f, core=core, hoist=hoist)(inst)
    assert info.value.instance == 2 and type(info.value.__cause__) is IndexError
    for (x, _), (x_e, _) in zip(inst, eager):
        torch.testing.assert_close(x, x_e)
