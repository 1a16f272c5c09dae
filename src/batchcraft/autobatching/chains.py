"""Fused recurrences: a cell's per-step chains run as one recurrent-layer call (issue 14 item 7).

A recurrent cell called once per time step (BiRNN's ``h, c = self.fwd(x, (h, c))`` with
``self.fwd = static_block(nn.LSTMCell(...))``) records one node per step; the depth scheduler
runs the t-th steps of all instances as one group, so a sentence of 40 words costs 40 groups per
direction, each a small matrix multiply and a dozen elementwise kernels. When the trace proves
it equivalent, all chains of that cell in a flush run instead as **one** packed
``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` call, the kernel ``nn.LSTM`` and its
kind run (oneDNN on the CPU, cuDNN on a GPU), with the chains laid out as a packed sequence
(longest first, as ``pack_sequence`` orders them).

What has to hold, checked per flush (:func:`plan`):

1. the signature's program is exactly a cell step (:func:`spec_of`): the input projection
   ``F.linear(x, W_ih, b_ih)`` and the gates of :mod:`cells` with ``W_hh, b_hh``, per instance on
   1-D rows (``unsqueeze(0)`` / ``squeeze(0)`` around it, as ``nn.LSTMCell.forward`` does for
   unbatched input), parameters shared, no autocast;
2. its nodes form chains (``Recorder.chains`` in the C core): a node's state inputs are the
   outputs of at most one other node of the signature, no node has two successors, no ``x`` comes
   from the chain;
3. (LSTM) the layer returns every step's ``h`` but only the *last* ``c`` of a chain: every other
   ``c`` must be dead -- read by no recorded operation but its successor and held by no live lazy
   value (the C core counts the lazy objects of each output);
4. every ``x`` and every chain's initial state is computed before the signature's first group.

Anything else keeps the per-step groups. Values agree with the per-step groups within float32
rounding (the same products, summed in the layer's order); gradients flow through the layer. The
``c`` rows of non-final steps are never read (by 3.); the layer call leaves them NaN. Only with
the C recorder and the depth scheduler; statistics count each fused call under
``groups_by_rule["fused_<kind>"]``.

Two refinements, both measured on BiRNN (hidden 256, 64 UD sentences, one thread: 68 -> 53 ms a
batch):

* **Inference without the layer call** (:func:`stepwise`, LSTM and GRU, with elementwise fusion
  on): one input projection for every step (through the kernel selector), then per step one
  recurrent product and the gates as one C kernel writing straight into the output rows. torch's
  packed layer spends a fifth of its time in the dozen ATen calls of each step's gates.
* **Readers re-levelled** (:func:`relevel`): what reads the steps' outputs (a tagger's per-word
  ``cat`` and output layer) was recorded at the depths of the steps, one group per step; once the
  steps are one call, those readers are all ready together and run as one group per signature
  (BiRNN: 146 batched calls a batch -> 38).
"""

from __future__ import annotations

import math

import torch

from batchcraft.autobatching import cells as _cells
from batchcraft.autobatching.descs import DESCS
from batchcraft.autobatching.kernels import TORCH_LINEAR as _LINEAR
from batchcraft.autobatching.gather import index_tensor
from batchcraft.autobatching.signature import LEAF, SIGNATURES
from batchcraft.autobatching.threadstate import tangents_possible

#: signatures with fewer nodes in a flush keep their per-step groups
MIN_NODES = 8

_KINDS = {  # gates function -> (kind, number of states, layer function)
    _cells.lstm_gates: ("lstm", 2, torch._VF.lstm),
    _cells.gru_gates: ("gru", 1, torch._VF.gru),
    _cells.rnn_tanh_gates: ("rnn_tanh", 1, torch._VF.rnn_tanh),
    _cells.rnn_relu_gates: ("rnn_relu", 1, torch._VF.rnn_relu),
}


_NONE = (type(None), None)  # how signature.flatten writes a None argument


class ChainSpec:
    """A cell-step program: which inputs are ``x`` and the states, and the layer's parameters."""

    __slots__ = ("kind", "n_states", "layer", "x", "states", "params", "has_biases")

    def __init__(self, kind, n_states, layer, x, states, params, has_biases):
        self.kind, self.n_states, self.layer = kind, n_states, layer
        self.x, self.states, self.params, self.has_biases = x, states, params, has_biases


def _dim0(step, name) -> bool:
    """``step`` is ``name(<tensor>, 0)`` with nothing else."""
    if step.name != name or step.struct[1] is not None:
        return False
    items = step.struct[0][1] if type(step.struct[0]) is tuple and len(step.struct[0]) == 2 else None
    return items is not None and len(items) == 2 and items[0] is LEAF and items[1] == (int, 0) and len(step.refs) == 1


def spec_of(prog) -> ChainSpec | None:
    """The :class:`ChainSpec` of ``prog`` when it is one cell step on 1-D rows (cached), else None."""
    cache = prog.lowered
    if "chain_spec" in cache:
        return cache["chain_spec"]
    spec = None
    try:
        spec = _match(prog)
    finally:
        cache["chain_spec"] = spec
    return spec


def _match(prog):
    if prog.n_ragged or prog.n_in < 2:
        return None
    src = {}  # ("val", k, 0) of an unsqueeze/squeeze -> what it wraps
    linear = gates = None
    for st in prog.steps:
        if _dim0(st, "unsqueeze") and st.refs[0][0] == "in":
            if len(DESCS[st.dids[0]][0]) != 1:
                return None
            src[("val", st.index, 0)] = st.refs[0]
        elif _dim0(st, "squeeze") and st.refs[0][0] == "val":
            src[("val", st.index, 0)] = st.refs[0]
        elif st.func is _LINEAR and linear is None and gates is None:
            linear = st
        elif st.func in _KINDS and linear is not None and gates is None:
            gates = st
        else:
            return None
    if linear is None or gates is None:
        return None
    kind, n_states, layer = _KINDS[gates.func]
    consts = lambda st, n: [r[1] for r in st.refs[n:]] if all(r[0] == "const" for r in st.refs[n:]) else None  # noqa: E731
    lin_w, gate_w = consts(linear, 1), consts(gates, 1 + n_states)
    if lin_w is None or gate_w is None or len(lin_w) != len(gate_w) or len(lin_w) not in (1, 2):
        return None
    if linear.struct[1] is not None or gates.struct[1] is not None:
        return None
    lin_items = linear.struct[0][1]
    gate_items = gates.struct[0][1]
    # bias given (a tensor) or absent / None for both; nothing but tensors and None positionally
    if len(lin_items) > 3 or any(it is not LEAF and it != _NONE for it in lin_items):
        return None
    if len(gate_items) > 3 + n_states or any(it is not LEAF and it != _NONE for it in gate_items):
        return None
    if (len(lin_w) == 2) != (len([it for it in gate_items if it is LEAF]) == 3 + n_states):
        return None
    # x and the states reach the step through unsqueeze(0) (per-instance rows are 1-D), the
    # outputs leave through squeeze(0): nn.LSTMCell.forward's form for unbatched input
    x_ref = src.get(linear.refs[0])
    if x_ref is None or x_ref[0] != "in" or gates.refs[0] != ("val", linear.index, 0):
        return None
    states = []
    for r in gates.refs[1:1 + n_states]:
        r = src.get(r)
        if r is None or r[0] != "in":
            return None
        states.append(r[1])
    ins = [x_ref[1], *states]
    if len(set(ins)) != len(ins) or prog.n_in != len(ins):
        return None
    outs = [src.get(r) if r in src and r[0] == "val" and prog.steps[r[1]].name == "squeeze" else None
            for r in prog.out_refs]
    if outs != [("val", gates.index, s) for s in range(n_states)]:
        return None
    params = [lin_w[0], gate_w[0]] + ([lin_w[1], gate_w[1]] if len(lin_w) == 2 else [])
    if any(not isinstance(p, torch.Tensor) or p.dim() != (2 if i < 2 else 1) for i, p in enumerate(params)):
        return None
    return ChainSpec(kind, n_states, layer, x_ref[1], tuple(states), params, len(lin_w) == 2)


class Chains:
    """One fused call: the chains (lists of nodes, each in step order) of one signature, in one phase."""

    __slots__ = ("info", "spec", "chains", "phase")

    def __init__(self, info, spec, chains, phase=0):
        self.info, self.spec, self.chains, self.phase = info, spec, chains, phase


#: why a recurrent-cell block's steps were not packed (``RunStats.recurrences_unpacked``)
UNPACKED_FORM = ("a cell call in a form that is not packed (packing takes one cell on per-instance (H,) "
                 "rows, not (1, H), with its input and state passed to the block and its weights captured; "
                 "a tree of cells does not pack in any form)")
UNPACKED_WAITS = ("one step per flush: the instances request a value between the steps (a break on the "
                  "state), so each step runs as its own group")
UNPACKED_BARE = ("a cell called outside a static block: its projection and gates record as two operations "
                 "and batch step by step; over a sequence, static_block(nn.GRUCell(...)) (or LSTMCell / RNNCell) "
                 "on per-instance (H,) rows packs its steps (a tree of cells batches depth by depth either way)")
UNPACKED_CHAINS = "its steps do not form chains (a step's state is also read elsewhere)"
UNPACKED_INPUTS = "inputs or initial states are computed after the first step (from the recurrence itself)"


def plan(rec, groups, note=None, waits=False):
    """Which signatures of this flush run as one layer call.

    Args:
        rec: the recorder (C core: ``chains``, ``input_depths``).
        groups (list): ``[(key, nodes), ...]`` in run order, key = ``(phase, depth, sid)``.
        note: optional ``note(reason, steps)``, told why a recurrent-cell block with enough
            steps was not packed (:data:`UNPACKED_FORM` and the others).
        waits (bool): this flush runs at a value request (a cell block's single step here is
            then noted as :data:`UNPACKED_WAITS`).
    Returns:
        ``(schedule, rest)``: ``schedule`` lists ``("group", key, nodes)`` and ``("chains",
        Chains)`` items in run order (a fused signature at its first group's place); ``rest`` the
        groups that still run per step.
    """
    by_sig: dict = {}
    for i, (key, _) in enumerate(groups):
        by_sig.setdefault((key[0], key[2]), []).append(i)
    fused: dict = {}
    for (_, sid), idxs in by_sig.items():
        info = SIGNATURES.by_sid[sid]
        if len(idxs) < 2:
            if note is not None and waits and not info.ragged and info.program is not None:
                if info.func in _KINDS:
                    note(UNPACKED_BARE, len(groups[idxs[0]][1]))
                elif spec_of(info.program) is not None:
                    note(UNPACKED_WAITS, len(groups[idxs[0]][1]))
            continue
        if info.state[2] is not None or info.ragged:
            continue
        prog = info.program
        spec = spec_of(prog) if prog is not None else None
        nodes = [nd for i in idxs for nd in groups[i][1]]
        if len(nodes) < MIN_NODES:
            continue
        if spec is None:
            if note is not None and prog is not None and any(st.func in _KINDS for st in prog.steps):
                note(UNPACKED_BARE if info.func in _KINDS else UNPACKED_FORM, len(nodes))
            continue
        pred = rec.chains(nodes, spec.x, spec.states[0], spec.states[1] if spec.n_states == 2 else -1)
        if pred is None:
            if note is not None:
                note(UNPACKED_CHAINS, len(nodes))
            continue
        mind, deep = rec.input_depths(nodes, prog.n_in)
        heads = [nd for nd, p in zip(nodes, pred) if p < 0]
        _, deep_h = rec.input_depths(heads, prog.n_in)
        if deep[spec.x] >= mind or any(deep_h[s] >= mind for s in spec.states):
            if note is not None:
                note(UNPACKED_INPUTS, len(nodes))
            continue
        succ = {p: i for i, p in enumerate(pred) if p >= 0}
        chains = []
        for i, p in enumerate(pred):
            if p < 0:
                chain = [nodes[i]]
                while i in succ:
                    i = succ[i]
                    chain.append(nodes[i])
                chains.append(chain)
        fused[idxs[0]] = Chains(info, spec, chains, groups[idxs[0]][0][0])
        for i in idxs[1:]:
            fused[i] = None
    if not fused:
        return [("group", k, n) for k, n in groups], groups
    schedule, rest = [], []
    for i, (key, nodes) in enumerate(groups):
        if i in fused:
            if fused[i] is not None:
                schedule.append(("chains", fused[i]))
        else:
            schedule.append(("group", key, nodes))
            rest.append((key, nodes))
    return schedule, rest


def fuse(rec, groups, note=None, waits=False):
    """:func:`plan` then :func:`relevel`, again until no more signature fuses.

    A recurrence that reads another's per-step outputs (the second layer of a stacked LSTM) is
    recorded at the first's per-step depths, so its inputs are not all ready before its first
    step and :func:`plan` keeps it per step; once the first is one call and re-levelled, its
    inputs are ready at one depth and the next pass fuses it. ``note`` hears only the last pass
    (the one that fused nothing more), so a recurrence fused in a later pass is not reported as
    unpacked.

    Returns:
        ``(schedule, groups, merged)``: as :func:`plan`, and the number of groups re-levelling
        merged into others.
    """
    notes: list = []
    collect = None if note is None else (lambda reason, steps: notes.append((reason, steps)))
    schedule, rest = plan(rec, groups, collect, waits)
    fused = len(rest) < len(groups)
    merged = 0
    while fused:
        n = len(rest)
        schedule, rest = relevel(rec, schedule)
        merged += n - len(rest)
        notes.clear()
        more, left = plan(rec, rest, collect, waits)
        fused = len(left) < len(rest)
        if fused:
            schedule, rest = _splice(schedule, more), left
    if note is not None:
        for reason, steps in notes:
            note(reason, steps)
    return schedule, rest, merged


def _splice(schedule, more):
    """``schedule`` with the groups :func:`plan` fused in ``more`` (its plan of the schedule's
    groups) replaced by their fused call, at the place of the first of them."""
    kept = {it[1] for it in more if it[0] == "group"}
    units = {(it[1].phase, it[1].info.sid): it for it in more if it[0] == "chains"}
    out = []
    for it in schedule:
        if it[0] == "group" and it[1] not in kept:
            unit = units.pop((it[1][0], it[1][2]), None)
            if unit is not None:
                out.append(unit)
            continue
        out.append(it)
    return out


def relevel(rec, schedule):
    """Merge the groups that read fused recurrences: give each item of ``schedule`` (from
    :func:`plan`) the depth of its deepest input item plus one, a fused call counting one step.

    The readers of a recurrence's outputs (BiRNN's per-word ``cat`` and output layer) were
    recorded at the depths of the steps they read, one group per step; once the steps run as one
    layer call they are all ready at once, and the groups of one signature that reach the same
    new depth run as one (the node lists concatenated; a group's nodes stay independent, as no
    item reads one at its own depth). The recorder's node depths are rewritten to match, so the
    later stages of the flush (hoisting's ``input_depths``) see the order that runs.

    Returns:
        ``(schedule, groups)`` as :func:`plan` returns them, in the new (phase, depth) order; the
        arguments unchanged when ``rec.relevel`` declines (a node in two items, or an item
        reading a later one).
    """
    items = [it[2] if it[0] == "group" else [nd for c in it[1].chains for nd in c] for it in schedule]
    levels = rec.relevel(items)
    if levels is None:
        return schedule, [(it[1], it[2]) for it in schedule if it[0] == "group"]
    merged: dict = {}
    order = []
    for it, lv in zip(schedule, levels):
        if it[0] == "group":
            phase, _, sid = it[1]
            key = (phase, lv, sid)
            nodes = merged.get(key)
            if nodes is None:
                merged[key] = nodes = list(it[2])
                order.append(((phase, lv), len(order), ("group", key, nodes)))
            else:
                nodes.extend(it[2])
        else:
            order.append(((it[1].phase, lv), len(order), it))
    order.sort(key=lambda o: (o[0], o[1]))
    schedule = [o[2] for o in order]
    return schedule, [(it[1], it[2]) for it in schedule if it[0] == "group"]


def packed(chains):
    """Packed-sequence layout: ``(nodes in row order, batch sizes, row of each chain's last step,
    heads in chain order)``, chains longest first (ties in recording order)."""
    order = sorted(chains, key=len, reverse=True)
    rows, sizes = [], []
    for t in range(len(order[0])):
        step = [c[t] for c in order if len(c) > t]
        sizes.append(len(step))
        rows += step
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    last = [offsets[len(c) - 1] + j for j, c in enumerate(order)]
    return rows, sizes, last, [c[0] for c in order]


def run(spec, x, states, sizes, last, linear=None, fused=False):
    """The chains' steps: ``x`` (N, in) packed rows, ``states`` per state (B, H) in chain order ->
    ``(outputs, stepwise)``: the per-step outputs, each (N, H), and whether :func:`stepwise` ran.

    With ``fused`` and where :func:`stepwise` applies (inference, float32 on the CPU, LSTM or
    GRU), the steps run there; otherwise as the layer call (LSTM: ``c`` rows of non-final steps
    are then NaN). ``linear``: the input projection's ``F.linear`` (the kernel selector's; None:
    torch's)."""
    if fused and spec.kind in _STEPWISE:
        outs = stepwise(spec, x, states, sizes, linear)
        if outs is not None:
            return outs, True
    batch_sizes = torch.tensor(sizes, dtype=torch.int64)  # on the CPU, as PackedSequence keeps it
    hx = [s.unsqueeze(0) for s in states]
    res = spec.layer(x, batch_sizes, hx if spec.n_states == 2 else hx[0], spec.params, spec.has_biases,
                     1, 0.0, False, False)
    h = res[0]
    if spec.n_states == 1:
        return [h], False
    idx = index_tensor(last, h.device)  # pinned and non-blocking on a GPU: no host wait (gather.py)
    c = torch.full_like(h, math.nan).index_copy(0, idx, res[2][0])
    return [h, c], False


_STEPWISE = ("lstm", "gru")
_F32 = torch.float32
_fuse = None


def stepwise(spec, x, states, sizes, linear=None):
    """The chains' steps without the layer call, for inference: the input projection of every
    step as one product (``linear``, the kernel selector's: oneDNN where it is faster here), then
    per step one recurrent product ``h W_hh^T + b_hh`` written for the step's rows and the gates as
    one C kernel (:func:`batchcraft.autobatching.fuse.gates_call`) that writes ``h'`` (and ``c'``)
    straight into the output rows.

    Why: torch's packed layer runs each step's gates as about a dozen ATen calls and copies the
    step's outputs; at BiRNN's shapes here (1,521 rows, hidden 256, one thread) that is a fifth
    of the layer (24 ms a direction against 19.9 this way). Same products, same order of the
    gates' arithmetic as ATen's ``lstm_cell`` / ``gru_cell``; the sigmoid and tanh are the fused
    kernels' (within a few float32 units in the last place of torch's).

    Returns:
        the per-step outputs as :func:`run` (``[h]`` or ``[h, c]``, each (N, H), every ``c`` row
        that step's), or None where it does not apply (autograd, autocast, a forward-mode AD
        level, another dtype, device or layout, no C extension); the caller then runs the layer.
    """
    global _fuse
    if _fuse is None:
        from batchcraft.autobatching import fuse as _f
        _fuse = _f
    params = spec.params
    if (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)
                                     or any(s.requires_grad for s in states))) \
            or torch.is_autocast_enabled("cpu") or tangents_possible() or not x.is_cpu or x.dtype is not _F32 \
            or any(t.dtype is not _F32 or not t.is_cpu or t.layout is not torch.strided
                   for t in (*params, *states)):
        return None
    w_ih, w_hh = params[0], params[1]
    b_ih, b_hh = (params[2], params[3]) if spec.has_biases else (None, None)
    H = w_hh.shape[1]
    fc = _fuse.gates_call(spec.kind, H, False)
    if fc is None:
        return None
    kernel = fc.kernel  # called on raw row addresses: every operand is checked here, once
    lstm = spec.n_states == 2
    # the state the gates read (LSTM: c; GRU: h), as rows of unit column stride
    s0 = states[1] if lstm else states[0]
    s0 = s0.resolve_neg()
    if s0.dim() != 2 or (H > 1 and s0.stride(1) != 1):
        s0 = s0.contiguous()
    gx = (linear or _LINEAR)(x, w_ih, b_ih).contiguous()
    wt = w_hh.t()
    n, kh = gx.shape
    h_out = gx.new_empty((n, H))
    c_out = gx.new_empty((n, H)) if lstm else h_out
    gh_rows = gx.new_empty((sizes[0], kh))  # each step's recurrent product, written in place
    gx_p, gh_p, c_p, h_p = gx.data_ptr(), gh_rows.data_ptr(), c_out.data_ptr(), h_out.data_ptr()
    row, st_p, st_stride = H * 4, s0.data_ptr(), s0.stride(0)
    zeros = (0, 0, 0)
    h = states[0]
    off = 0
    for s in sizes:
        gh = gh_rows[:s]
        if b_hh is None:
            torch.mm(h[:s], wt, out=gh)
        else:
            torch.addmm(b_hh, h[:s], wt, out=gh)
        outs = (c_p + off * row, h_p + off * row) if lstm else (h_p + off * row,)
        kernel(s, (gx_p + off * kh * 4, gh_p, st_p), (kh, kh, st_stride), zeros, (s, s, s), outs)
        st_p, st_stride = outs[0], H  # the next step reads this step's c (LSTM) or h (GRU) rows
        h = h_out[off:off + s]
        off += s
    return [h_out, c_out] if lstm else [h_out]


__all__ = ["plan", "fuse", "relevel", "stepwise", "spec_of", "packed", "run", "Chains", "ChainSpec", "MIN_NODES", "UNPACKED_BARE"]
