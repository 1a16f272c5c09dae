"""Cell modules inside autobatch: the direct recording of nn.LSTMCell / GRUCell / RNNCell (cells.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from batchcraft import autobatch
from batchcraft.errors import InstanceError
from equivalence import CORES, assert_matches_eager

H = 6


def _cells():
    torch.manual_seed(0)
    return {"lstm": nn.LSTMCell(H, H), "gru": nn.GRUCell(H, H), "rnn_tanh": nn.RNNCell(H, H),
            "rnn_relu": nn.RNNCell(H, H, nonlinearity="relu"), "gru_nobias": nn.GRUCell(H, H, bias=False)}


def _chain(cell, kind, rank, steps=3):
    def fn(x):
        x = x if rank == 1 else x.unsqueeze(0)
        h = torch.zeros(H) if rank == 1 else torch.zeros(1, H)
        c = torch.zeros_like(h)
        for _ in range(steps):
            if kind == "lstm":
                h, c = cell(x, (h, c))
            else:
                h = cell(x, h)
            x = torch.tanh(h)
        return h
    return fn


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu", "gru_nobias"])
def test_cells_record_two_operations_and_match_eager(kind, rank, core):
    cell = _cells()[kind]
    fn = _chain(cell, kind, rank)
    xs = [torch.randn(H) for _ in range(5)]
    f = assert_matches_eager(fn, xs, list(cell.parameters()), core=core)
    slow = assert_matches_eager(fn, xs, list(cell.parameters()), fast_modules=False, core=core)
    # torch's forward on 1-D rows adds an unsqueeze of the input and of each state, and a
    # squeeze of each output, per call: 5 for the LSTM, 3 for the others
    saved = len(xs) * 3 * ((5 if kind == "lstm" else 3) if rank == 1 else 0)
    assert f.stats.ops_recorded == slow.stats.ops_recorded - saved, (f.stats.ops_recorded, slow.stats.ops_recorded)
    assert f.stats.fallbacks == 0 and slow.stats.fallbacks == 0
    assert nn.GRUCell.forward.__name__ == "forward" and not hasattr(nn.GRUCell.forward, "__wrapped__")


def test_fast_modules_off_runs_torchs_forward():
    cell = _cells()["gru"]
    xs = [torch.randn(H) for _ in range(4)]
    f = assert_matches_eager(_chain(cell, "gru", 1), xs, list(cell.parameters()), fast_modules=False)
    assert f.stats.ops_recorded > len(xs) * 3 * 3  # unsqueeze / cell / squeeze per step


def test_other_forms_use_torchs_forward():
    torch.manual_seed(1)
    gru = nn.GRUCell(H, H)

    class MyCell(nn.GRUCell):  # its own forward: left alone
        def forward(self, x, h=None):
            return super().forward(x, h) * 0.5

    mine = MyCell(H, H)
    x0 = torch.randn(H)

    def fn(x):
        a = gru(x)                      # no state: torch's forward makes zeros
        b = gru(x0, a)                  # shared input: torch's forward, its ops batch by rules
        c = mine(x, b)                  # subclass: super().forward reaches the fast path
        return gru(x.unsqueeze(0), c.unsqueeze(0))[0] + c  # ranks agree (2-D)

    assert_matches_eager(fn, [torch.randn(H) for _ in range(4)], list(gru.parameters()) + list(mine.parameters()))


def test_a_parametrized_weight_is_read_through_its_parametrization():
    torch.manual_seed(2)
    cell = nn.GRUCell(H, H)

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(cell, "weight_hh", Double())
    assert_matches_eager(_chain(cell, "gru", 1), [torch.randn(H) for _ in range(4)], list(cell.parameters()))


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("make_state, message", [
    (lambda x: torch.zeros(H + 1), "hidden"),                        # wrong hidden size
    (lambda x: torch.zeros(2, H), "hidden"),                         # a 2-D state for a 1-D input
    (lambda x: torch.zeros(3, H) + x.unsqueeze(0)[:, :1], "batch"),  # per-instance, batch 3 vs 1
])
def test_mis_shaped_states_raise_atens_error(make_state, message, fast):
    # torch's forward raises for these; the split projection + gates would have broadcast
    cell = nn.GRUCell(H, H)

    def fn(x):
        h = make_state(x)
        return cell(x if h.dim() == 1 else x.unsqueeze(0), h)

    for x in [torch.randn(H)]:
        with pytest.raises(RuntimeError, match=message):
            fn(x)
    with pytest.raises(InstanceError, match=message):
        autobatch(fn, fast_modules=fast)([torch.randn(H), torch.randn(H)])


def test_errors_leave_torch_function_on_and_the_patch_removed():
    cell = nn.GRUCell(H, H)
    with pytest.raises(InstanceError):
        autobatch(lambda x: cell(x, torch.zeros(H + 1)))([torch.randn(H), torch.randn(H)])
    with pytest.raises(InstanceError):
        autobatch(lambda x: cell(x, torch.zeros(2, H)))([torch.randn(H)])  # eager: rank mismatch
    assert torch._C._is_torch_function_enabled() and torch._C._len_torch_function_stack() == 0
    assert not hasattr(nn.GRUCell.forward, "__wrapped__") and not hasattr(nn.LSTMCell.forward, "__wrapped__")
    # eager calls outside autobatch are untouched
    assert cell(torch.randn(H), torch.zeros(H)).shape == (H,)


@pytest.mark.parametrize("kind", ["gru", "rnn_tanh"])
def test_a_sequence_as_the_state_of_a_single_state_cell_raises_as_in_eager(kind):
    cell = _cells()[kind]
    with pytest.raises(AttributeError):
        cell(torch.randn(H), (torch.zeros(H),))
    with pytest.raises(InstanceError, match="has no attribute 'dim'"):
        autobatch(lambda x: cell(x, (torch.zeros(H) + x,)))([torch.randn(H), torch.randn(H)])


@pytest.mark.parametrize("core", CORES)
def test_checks_remembered_within_a_call_follow_weight_changes_and_new_shapes(core):
    # cells.py remembers a passed check per (module, gates, descriptors) with the weights it saw:
    # a weight replaced mid-call, a changed nonlinearity or a state of another size is checked anew
    torch.manual_seed(7)
    cell = nn.RNNCell(H, H)
    w_new = nn.Parameter(torch.randn(H, H) * 0.3)
    w_old = cell.weight_hh

    def fn(x):
        h = torch.zeros(H)
        h = cell(x, h) + 0 * x
        h = cell(x, h)
        cell.weight_hh = w_new       # same shapes, another tensor: must be the one used
        cell.nonlinearity = "relu"
        h = cell(x, h)
        cell.weight_hh = w_old
        cell.nonlinearity = "tanh"
        return cell(x, h), cell(x.unsqueeze(0), h.unsqueeze(0))  # 2-D: checked as 2-D

    assert_matches_eager(fn, [torch.randn(H) for _ in range(4)], list(cell.parameters()) + [w_new], core=core)
    bad = nn.LSTMCell(H, H)

    def wrong(x):
        h = torch.zeros(H)
        h, c = bad(x, (h, h))
        return bad(x, (h, torch.zeros(H + 1)))  # the second call's state has the wrong size

    with pytest.raises(InstanceError, match="hidden|size"):
        autobatch(wrong, core=core)([torch.randn(H) for _ in range(3)])


def _tree_of_cells(kind, shared_state):
    """A binary tree over a list, a cell per node (no chain of one cell over time steps, so the
    gates run as batched programs, not as one nn.GRU / nn.LSTM call)."""
    from batchcraft import static_block

    torch.manual_seed(1)
    cell = static_block(nn.GRUCell(H, H) if kind == "gru" else nn.LSTMCell(H, H))

    def node(xs):
        if len(xs) == 1:
            if shared_state:  # the state created per call: one (H,) row shared by the group
                return cell(xs[0], torch.zeros(H)) if kind == "gru" else cell(xs[0], (torch.zeros(H), torch.ones(H)))[0]
            return cell(xs[0], xs[0].tanh()) if kind == "gru" else cell(xs[0], (xs[0].tanh(), xs[0].sin()))[0]
        mid = len(xs) // 2
        left, right = node(xs[:mid]), node(xs[mid:])
        return cell(left, right) if kind == "gru" else cell(left, (right, left * right))[0]

    return cell, node


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("shared_state", [False, True])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_gates_run_as_one_fused_kernel_and_match_eager(kind, shared_state, core):
    from batchcraft.autobatching import cells, fuse

    cell, node = _tree_of_cells(kind, shared_state)
    g = torch.Generator().manual_seed(2)
    insts = [[torch.randn(H, generator=g) for _ in range(k)] for k in (1, 2, 3, 5, 4, 7)]
    with torch.no_grad():
        f = assert_matches_eager(node, insts, [], core=core)
        off = assert_matches_eager(node, insts, [], core=core, fuse_elementwise=False)
    if fuse.available:
        assert f.stats.fused_kernels > off.stats.fused_kernels
    # with autograd the kernel declines: torch's calls, the same values and gradients
    leaves = [x.requires_grad_() for inst in insts for x in inst]
    assert_matches_eager(node, insts, list(cell.parameters()) + leaves, core=core)
    # the kernel alone, against the torch calls it replaces, on rows of a wider buffer
    k = 3 if kind == "gru" else 4
    gi, gh = torch.randn(5, k * H + 3)[:, 3:], torch.randn(5, k * H)
    state = torch.randn(H) if shared_state else torch.randn(5, H)
    ref = (cells.gru_gates(gi, state, torch.eye(k * H, H), linear=lambda h, w, b: gh) if kind == "gru"
           else cells.lstm_gates(gi, None, state, None, linear=lambda h, w, b: gh)[::-1])
    got = cells.fused_gates(kind, gi, gh, state)
    if fuse.available:
        for a, b in zip(got, [ref] if kind == "gru" else ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    else:
        assert got is None
    assert cells.fused_gates(kind, torch.randn(5, 2 * k * H)[:, ::2], gh, state) is None  # columns apart: torch's calls
