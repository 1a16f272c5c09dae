"""Elementwise fusion: a batched program's elementwise tail runs as one C kernel (issue 14, item 6).

After a tree level's or a time step's matrix products, a lowered program makes a torch call per
elementwise step: a TreeLSTM level does ``iou + U h``, three gate nonlinearities, two products
and a sum, each on the level's tens of rows, where the call (dispatch, output allocation, a pass
over memory) costs more than the maths. This stage finds *clusters* of such steps in a program
and runs each as a :class:`~batchcraft.autobatching._fused.Kernel`, row by row with the row's
intermediates in a scratch buffer: one call, one pass, only the values read outside the cluster
written.

Fused (per instance, float32): ``add``/``sub``/``mul`` of two values or a value and a Python
number (operators, ``torch.*`` and method forms, without ``alpha``), ``neg``, ``relu``,
``sigmoid``, ``tanh``, ``exp``, and ``chunk`` along the last dimension (its pieces are column
views). Operands are the program's values with one dimension per instance (``(W,)``; in a ragged
program also the members' ``(k, W)`` rows and dense values broadcast over them by segment),
and shared ``(W,)`` tensors.

A cluster runs at the point where its first value is read by a step outside it (or at the
program's end); a step that may write memory ends every open cluster, so no step moves past a
write. The lowered source keeps the unfused steps as the cluster's other branch::

    _r = _fz3(n, None, I0, v3_0, v14_0)
    if _r is None:                 # declined: the steps as lowered
        v4_0 = _F3(I0, v3_0)
        ...
    else:
        v15_0, v18_0 = _r

:class:`FusedCall` declines at run time unless every operand is a plain float32 CPU strided
tensor with unit stride along its row, the shapes are the trace's, and no operand needs autograd
(``torch.is_grad_enabled()`` and ``requires_grad``; a forward-AD level is active) or autocast is on:
training, dual tensors, other dtypes and devices run torch's calls. Values: add/sub/mul/neg/relu are torch's bits; sigmoid, tanh and exp
are within a few float32 units in the last place (``_fused.c``; torch's own kernels differ by as
much between a contiguous and a strided input).

Source: kernel fusion of elementwise tails as in ACRoBat's generated kernels (Fegade et al.
2024, §5) and Cortex (MLSys 2021); DyNet runs each elementwise node type as one batched call.
"""

from __future__ import annotations

import operator
import threading

import torch
import torch.autograd.forward_ad as _fwad
import torch.nn.functional as F

from batchcraft.autobatching.descs import DESCS
from batchcraft.autobatching.gather import Rows as _Rows
from batchcraft.autobatching.rules import rule_for
from batchcraft.autobatching.signature import rebuild

try:  # optional extension, as the C core: without a compiler no program is fused
    from batchcraft.autobatching import _fused
except ImportError:  # pragma: no cover - exercised by the CC=/bin/false install
    _fused = None

available = _fused is not None
if _fused is not None:  # rows and columns over torch's own OpenMP team (openmp.py)
    from batchcraft.autobatching import openmp as _openmp

    _openmp.install(_fused)

# opcodes of _fused.c
ADD, SUB, MUL, ADD_S, SUB_S, MUL_S, RSUB_S, NEG, RELU, SIGMOID, TANH, EXP = range(12)
#: Kernel slot kinds (_fused.c)
IN, SCRATCH, OUT, VIEW = range(4)

_T = torch.Tensor
_UNARY = {}
for _code, _fns in ((NEG, (torch.neg, _T.neg, _T.__neg__, torch.negative, _T.negative)),
                    (RELU, (torch.relu, _T.relu, F.relu)),
                    (SIGMOID, (torch.sigmoid, _T.sigmoid, F.sigmoid, torch.special.expit)),
                    (TANH, (torch.tanh, _T.tanh, F.tanh)),
                    (EXP, (torch.exp, _T.exp))):
    for _f in _fns:
        _UNARY[_f] = _code
# binary: (op, operands swapped): a + b, b - a (rsub)...
_BINARY = {}
for _op, _fns in ((ADD, (torch.add, _T.add, _T.__add__, operator.add)),
                  (SUB, (torch.sub, _T.sub, _T.__sub__, torch.subtract, _T.subtract, operator.sub)),
                  (MUL, (torch.mul, _T.mul, _T.__mul__, torch.multiply, _T.multiply, operator.mul))):
    for _f in _fns:
        _BINARY[_f] = (_op, False)
for _op, _fns in ((ADD, (_T.__radd__,)), (SUB, (_T.__rsub__, torch.rsub)), (MUL, (_T.__rmul__,))):
    for _f in _fns:
        _BINARY[_f] = (_op, True)
_CHUNK = (torch.chunk, _T.chunk)
_SCALAR_OP = {ADD: ADD_S, SUB: SUB_S, MUL: MUL_S}
#: rules whose steps neither write memory nor run user code (a cluster may move past them); not
#: batch_norm / instance_norm (running statistics), scatter, setitem, vmap (anything) or unknown ones
_PURE_RULES = frozenset({"elementwise", "weight", "matmul", "dim", "direct", "flatten", "gates", "getitem", "max",
                         "new_factory", "permute", "repeat", "rnn_cell", "seq", "shape", "split", "squeeze",
                         "sum", "t", "transpose", "unbind", "unsqueeze"})
_F32 = torch.float32
_Param = torch.nn.Parameter
_is_grad = torch.is_grad_enabled
_autocast_on = torch.is_autocast_enabled
_MAX_EXACT_INT = 2 ** 24  # a Python int operand beyond this is not one float32 value


class _Counts(threading.local):
    """Per thread: fused kernel calls made and program steps they ran (read by the executor)."""

    def __init__(self):
        self.calls = 0
        self.steps = 0
        self.declined = 0


COUNTS = _Counts()


class _Leaf:
    __slots__ = ("j",)

    def __init__(self, j):
        self.j = j


class Cluster:
    """A set of fusable steps of one row space, run as one kernel.

    Attributes:
        members (list[int]): step indices, in program order.
        space: ``"node"`` (``n`` rows) or a ragged class (one row per list member).
        before (int | None): index of the step it runs before (None: at the program's end).
        operands (list[str]): Python expressions of its operands (program values).
        outputs (list[tuple]): value keys ``(step, slot)`` it returns, in order.
        remat (list[int]): member ``chunk`` steps to run again on the outputs (their pieces are
            read outside the cluster).
        call (FusedCall | None): the run-time entry (None until :func:`plan` finishes it).
    """

    def __init__(self, space):
        self.space = space
        self.members: list = []
        self.ops: list = []          # (code, dst key, a key, b key | None, scalar)
        self.views: dict = {}        # key -> (parent key, column offset)
        self.widths: dict = {}       # key -> width
        self.operand_keys: list = []  # operand keys in order
        self.operand_info: dict = {}  # key -> (expression, kind "b" / "g" / "q" / "c", width)
        self.before = None
        self.operands: list = []
        self.outputs: list = []
        self.remat: list = []
        self.call = None

    @property
    def n_ops(self) -> int:
        return len(self.ops)


class FusedCall:
    """The run-time entry of one cluster: checks the operands, allocates outputs, runs the kernel.

    Call: ``fc(rows, seg, *operands) -> list`` of output tensors ``(rows, width)``, or None when
    it declines (see the module docstring); ``seg`` is the segment ids of a ragged cluster's
    gathered operands (``(rows,)`` int64) or None.
    """

    __slots__ = ("kernel", "kinds", "widths", "out_widths", "n_steps")

    def __init__(self, kernel, kinds, widths, out_widths, n_steps):
        self.kernel = kernel
        self.kinds = tuple(kinds)
        self.widths = tuple(widths)
        self.out_widths = tuple(out_widths)
        self.n_steps = n_steps

    def __call__(self, rows, seg, *xs, dest=None, dmap=()):
        out = self._run(rows, seg, xs, dest, dmap)
        c = COUNTS
        if out is None:
            c.declined += 1
        else:
            c.calls += 1
            c.steps += self.n_steps
        return out

    def _run(self, rows, seg, xs, dest=None, dmap=()):
        try:
            return self._checked_run(rows, seg, xs, dest, dmap)
        except RuntimeError:  # data_ptr() of a tensor without storage: a torch.func wrapper (vmap)
            return None

    def _checked_run(self, rows, seg, xs, dest=None, dmap=()):
        ptrs = []
        strides = []
        index = []
        limits = []
        grad = _is_grad()
        if _autocast_on("cpu") or _fwad._current_level >= 0:
            return None  # autocast; a forward-AD level (dual tensors carry tangents the kernel drops)
        sp = 0
        if seg is not None:
            if not _row_ids(seg, rows):
                return None
            sp = seg.data_ptr()
        first = None
        for x, kind, w in zip(xs, self.kinds, self.widths):
            tx = type(x)
            if tx is _Rows:      # rows of a buffer through an index (gather.Rows): read in place
                b, ix = x.buffer, x.index
                if (kind != "b" or type(b) is not _T or not _plain_f32(b, grad) or b.dim() != 2 or b.shape[1] != w
                        or (w > 1 and b.stride(1) != 1) or not _row_ids(ix, rows) or (rows > 0 and b.numel() == 0)):
                    return None
                if first is None:
                    first = b
                ptrs.append(b.data_ptr())
                strides.append(b.stride(0))
                index.append(ix.data_ptr() if rows > 0 else 0)
                limits.append(b.shape[0])
                continue
            if (tx is not _T and tx is not _Param) or not _plain_f32(x, grad):
                return None
            sh = x.shape
            if kind == "b":      # one row per kernel row (the common case first)
                if sh != (rows, w):
                    return None
                st = x.stride()
                if w > 1 and st[1] != 1:
                    return None
                ptrs.append(x.data_ptr())
                strides.append(st[0])
                index.append(0)
                limits.append(rows)
                if first is None:
                    first = x
                continue
            d = len(sh)
            if kind == "c":      # shared (W,): every row reads it
                if d != 1 or sh[0] != w or (w > 1 and x.stride(0) != 1):
                    return None
                rs, ix = 0, 0
            else:                # "g" / "q": a dense (n, W) / (n, 1, W) value, row seg[r]
                if kind == "q":
                    if d != 3 or sh[1] != 1:
                        return None
                elif d != 2:
                    return None
                if sh[-1] != w or (w > 1 and x.stride(-1) != 1) or sp == 0 and rows > 0:
                    return None
                rs, ix = x.stride(0), sp
            if rows > 0 and x.numel() == 0:
                return None
            if first is None:
                first = x
            ptrs.append(x.data_ptr())
            strides.append(rs)
            index.append(ix)
            limits.append(x.shape[0])
        if first is None:
            return None
        if dest is None:
            outs = [first.new_empty((rows, w)) for w in self.out_widths]
        else:
            outs = [_into(dest, j, rows, w, first) for j, w in zip(dmap, self.out_widths)]
        if rows > 0:
            self.kernel(rows, tuple(ptrs), tuple(strides), tuple(index), tuple(limits),
                        tuple(o.data_ptr() for o in outs))
        return outs


_GATES: dict = {}


def gates_call(kind: str, width: int, shared_state: bool):
    """The :class:`FusedCall` of a recurrent cell's elementwise gates after its two projections,
    ``fc(rows, None, gi, gh, s) -> [out]`` (GRU: ``h'``; LSTM: ``c', h'``), or None without the
    extension. ``gi``, ``gh``: the input and recurrent projections ``(rows, 3H)`` (GRU) or
    ``(rows, 4H)`` (LSTM); ``s``: the state the gates read, ``h`` (GRU) or ``c`` (LSTM),
    ``(rows, H)``, or ``(H,)`` shared by every row. The ops are :mod:`cells`' in their order
    (ATen's ``gru_cell`` / ``lstm_cell``, ``aten/src/ATen/native/RNN.cpp``)."""
    if _fused is None or kind not in ("gru", "lstm"):
        return None
    key = (kind, width, shared_state)
    fc = _GATES.get(key)
    if fc is not None:
        return fc
    H = width
    k = 3 if kind == "gru" else 4
    slots = [(IN, 0, k * H, 0), (IN, 1, k * H, 0), (IN, 2, H, 0)]  # gi, gh, state
    ops = []

    def new(kind_, width_=H, ref=0, offset=0):
        slots.append((kind_, ref, width_, offset))
        return len(slots) - 1

    def op(code, a, b=-1, out=None):
        dst = new(SCRATCH) if out is None else new(OUT, ref=out)
        ops.append((code, dst, a, b, 0.0))
        return dst

    if kind == "gru":
        ir, iz, inn = (new(VIEW, H, 0, j * H) for j in range(3))
        hr, hz, hn = (new(VIEW, H, 1, j * H) for j in range(3))
        r = op(SIGMOID, op(ADD, hr, ir))
        z = op(SIGMOID, op(ADD, hz, iz))
        n = op(TANH, op(ADD, inn, op(MUL, hn, r)))
        op(ADD, op(MUL, op(SUB, 2, n), z), n, out=0)          # (h - n) * z + n
        n_out = 1
    else:
        g = new(SCRATCH, 4 * H)
        ops.append((ADD, g, 0, 1, 0.0))                         # gi + U h
        i, f, u, o = (op(SIGMOID if j != 2 else TANH, new(VIEW, H, g, j * H)) for j in range(4))
        c2 = op(ADD, op(MUL, f, 2), op(MUL, i, u), out=0)       # f * c + i * g
        op(MUL, o, op(TANH, c2), out=1)                          # o * tanh(c')
        n_out = 2
    kernel = _fused.Kernel(slots, ops, 3, n_out)
    fc = _GATES[key] = FusedCall(kernel, ("b", "b", "c" if shared_state else "b"), (k * H, k * H, H), (H,) * n_out, 1)
    return fc


def _into(dest, j, rows, w, like):
    """Output ``j`` of the program's outputs ``dest`` (rows of the executor's output arena, not read
    by anything yet) when the kernel can write it directly: ``(rows, w)`` float32 rows with unit
    column stride on the CPU; else a new tensor (the executor copies it as before)."""
    d = dest[j] if j >= 0 else None
    if (type(d) is not _T or d.dtype is not _F32 or not d.is_cpu or d.shape != (rows, w)
            or (w > 1 and d.stride(1) != 1) or d.requires_grad):
        return like.new_empty((rows, w))
    return d


def _plain_f32(x, grad) -> bool:
    """A float32 CPU strided tensor whose memory holds its values (no negative-view bit, a storage)
    and that needs no autograd: what the C loops may read by address. (A torch.func wrapper, such
    as vmap's batched tensor, passes; its ``data_ptr()`` raises: the callers decline then.)"""
    return (x.dtype is _F32 and x.is_cpu and x.layout is torch.strided and not (grad and x.requires_grad)
            and not x.is_neg() and not x._is_zerotensor())


def _row_ids(seg, rows) -> bool:
    """``seg`` is a contiguous ``(rows,)`` int64 CPU tensor of row numbers (checked in C)."""
    return (type(seg) is _T and seg.dtype is torch.int64 and seg.is_cpu and seg.dim() == 1
            and seg.shape[0] == rows and (rows < 2 or seg.stride(0) == 1))


def _space_and_plan(st, ragged_plan):
    """(row space, per-leaf ragged plan or None) of a step, or None when it is not elementwise."""
    if ragged_plan is not None and st.index in ragged_plan:
        entry = ragged_plan[st.index][0]
        if entry[0] != "elementwise":
            return None
        return entry[1], entry[2]
    return "node", None


def _value_width(shape, space):
    """Width of a per-instance value of ``shape`` in ``space``, or None (not one row of floats)."""
    if space == "node":
        return shape[0] if len(shape) == 1 else None
    return shape[1] if len(shape) == 2 else None


def _candidate(st, ragged_plan, fallbacks, batched):
    """(space, description) of a fusable step, or None. Description: ("op", code, [leaf specs],
    scalar) or ("chunk", pieces)."""
    if st.index in fallbacks or (st.info is not None and getattr(st.info, "program", None) is not None):
        return None
    sp = _space_and_plan(st, ragged_plan)
    if sp is None:
        return None
    space, rplan = sp
    func = st.func
    it = iter([_Leaf(j) for j in range(len(st.refs))])
    args = list(rebuild(st.struct[0], it))
    kwargs = rebuild(st.struct[1], it) if st.struct[1] is not None else {}
    for d in st.out_dids:
        desc = DESCS[d]
        if desc[1] is not _F32 or _value_width(desc[0], space) is None:
            return None
    width = _value_width(DESCS[st.out_dids[0]][0], space)
    if func in _CHUNK:
        if space != "node" or set(kwargs) - {"dim"} or len(args) not in (2, 3) or type(args[0]) is not _Leaf:
            return None
        if len(args) == 3 and "dim" in kwargs:
            return None
        pieces = args[1]
        dim = kwargs.get("dim", args[2] if len(args) == 3 else 0)
        if type(pieces) is not int or pieces < 1 or dim not in (0, -1) or not batched[args[0].j]:
            return None
        shape = DESCS[st.dids[args[0].j]][0]
        if len(shape) != 1 or shape[0] % pieces or len(st.out_dids) != pieces:
            return None
        if DESCS[st.dids[args[0].j]][1] is not _F32:
            return None
        return space, ("chunk", pieces, args[0].j, shape[0] // pieces)
    if len(st.out_dids) != 1:
        return None
    code = _UNARY.get(func)
    if code is not None:
        if len(args) != 1 or type(args[0]) is not _Leaf:
            return None
        if kwargs and not (func is F.relu and kwargs == {"inplace": False}):
            return None
        spec = _leaf_spec(st, args[0].j, space, rplan, width, batched)
        return (space, ("op", code, [spec], None)) if spec is not None and spec[0] != "c" else None
    b = _BINARY.get(func)
    if b is None or kwargs or len(args) != 2:
        return None
    op, swapped = b
    a0, a1 = (args[1], args[0]) if swapped else (args[0], args[1])
    leaves = [a for a in (a0, a1) if type(a) is _Leaf]
    if len(leaves) == 2:
        s0 = _leaf_spec(st, a0.j, space, rplan, width, batched)
        s1 = _leaf_spec(st, a1.j, space, rplan, width, batched)
        if s0 is None or s1 is None or (s0[0] == "c" and s1[0] == "c"):
            return None
        return space, ("op", op, [s0, s1], None)
    if len(leaves) != 1:
        return None
    other = a1 if type(a0) is _Leaf else a0
    if type(other) is int and abs(other) <= _MAX_EXACT_INT:
        other = float(other)
    if type(other) is not float:
        return None
    spec = _leaf_spec(st, leaves[0].j, space, rplan, width, batched)
    if spec is None or spec[0] == "c":
        return None
    if type(a0) is _Leaf:
        code = _SCALAR_OP[op]
    elif op == SUB:
        code = RSUB_S
    else:
        code = _SCALAR_OP[op]  # s + a, s * a: commutative in IEEE arithmetic
    return space, ("op", code, [spec], other)


def _leaf_spec(st, j, space, rplan, width, batched):
    """(kind, j, width) of operand leaf ``j``: kind "v" (a value of the cluster's space), "g" /
    "q" (a dense value gathered by segment, (n, W) / (n, 1, W)), "c" (shared (W,))."""
    ref = st.refs[j]
    if ref[0] != "const" and not batched[j]:  # a value computed from shared tensors only
        desc = DESCS[st.dids[j]]
        return ("c", j, width) if desc[1] is _F32 and tuple(desc[0]) == (width,) else None
    if ref[0] == "const":
        t = ref[1]
        if not isinstance(t, torch.Tensor) or t.dtype is not _F32:
            return None
        shape = tuple(t.shape)
        if shape != (width,) and not (space != "node" and shape == (1, width)):
            return None
        if len(shape) == 2:
            return None  # a (1, W) const in a ragged step: not one strided row here
        return "c", j, width
    desc = DESCS[st.dids[j]]
    if desc[1] is not _F32:
        return None
    shape = desc[0]
    p = rplan[j] if rplan is not None else None
    if type(p) is tuple:
        if p[0] == "gather" and p[1] == 0 and shape == (width,):
            return "g", j, width
        if p[0] == "gather_sq" and shape == (1, width):
            return "q", j, width
        return None
    if _value_width(shape, space) != width:
        return None
    return "v", j, width


def _key(ref):
    kind = ref[0]
    if kind == "val":
        return ("val", ref[1], ref[2])
    if kind == "const":
        return ("const", id(ref[1]))
    return (kind, ref[1])


def _is_barrier(st, ragged_plan, fallbacks) -> bool:
    """May running this step move past a cluster's members? Not if it may write memory or run
    user code (fallbacks, nested blocks, in-place and unknown operations)."""
    if st.index in fallbacks or (st.info is not None and getattr(st.info, "program", None) is not None):
        return True
    if ragged_plan is not None and st.index in ragged_plan:
        return False  # segment reductions, stacks, gathers: new tensors only
    name = getattr(st.func, "__name__", "")
    if name.endswith("_") and not name.endswith("__") or name.startswith("__i") or "out" in _kwarg_names(st):
        return True
    if "embedding" in name and _kwarg_value(st, "max_norm", None) is not None:
        return True  # renorms the table in place
    rule = rule_for(st.func)
    return rule is None or rule.name not in _PURE_RULES


def _kwarg_names(st):
    s = st.struct[1]
    return s[1] if s is not None and s[0] is dict else ()


def _kwarg_value(st, name, default):
    """A keyword argument's value as recorded (positional ones count as unknown: not None)."""
    s = st.struct[1]
    if name == "max_norm" and len(st.struct[0][1]) > 2:
        return "positional"
    if s is None or s[0] is not dict or name not in s[1]:
        return default
    v = s[2][s[1].index(name)]
    return None if v == (type(None), None) else v


def plan(prog, exprs, batched, ragged_plan=None, fallbacks=None) -> list:
    """The clusters of ``prog`` worth fusing (at least two operations each).

    Args:
        prog: the :class:`~batchcraft.autobatching.program.Program`.
        exprs (dict[int, list[str]]): per step, its leaves' Python expressions (program values).
        batched (dict[int, list[bool]]): per step and leaf: does the value have a row per node.
        ragged_plan (dict | None): :func:`ragged.analyse`'s plan of a ragged program.
        fallbacks (dict | None): steps run one instance at a time.
    Returns:
        list[Cluster] with ``call`` set, in the order they run.
    """
    if _fused is None:
        return []
    fallbacks = fallbacks or {}
    steps = prog.steps
    consumers: dict = {}
    for st in steps:
        for r in st.refs:
            if r[0] == "val":
                consumers.setdefault((r[1], r[2]), set()).add(st.index)
    outside_read = {("val", r[1], r[2]) for r in prog.out_refs if r[0] == "val"}
    open_: dict = {}
    owner: dict = {}   # step -> cluster
    done: list = []

    def close(cl, before):
        del open_[cl.space]
        cl.before = before
        done.append(cl)

    for st in steps:
        cand = _candidate(st, ragged_plan, fallbacks, batched[st.index])
        for r in st.refs:
            if r[0] == "val":
                cl = owner.get(r[1])
                if cl is not None and open_.get(cl.space) is cl and (cand is None or cand[0] != cl.space):
                    close(cl, st.index)
        if cand is None:
            if _is_barrier(st, ragged_plan, fallbacks):
                for cl in list(open_.values()):
                    close(cl, st.index)
            continue
        space, desc = cand
        cl = open_.get(space)
        if cl is None:
            cl = open_[space] = Cluster(space)
        _add(cl, st, desc, exprs[st.index])
        owner[st.index] = cl
    for cl in list(open_.values()):
        close(cl, None)
    out = []
    for cl in done:
        if cl.n_ops >= 2 and _finish(cl, consumers, outside_read):
            out.append(cl)
    return out


def _add(cl, st, desc, leaf_exprs):
    cl.members.append(st.index)
    if desc[0] == "chunk":
        _, pieces, j, w = desc
        src = _operand(cl, st, j, "v", w * pieces, leaf_exprs)
        for s in range(pieces):
            k = ("val", st.index, s)
            cl.views[k] = (src, s * w)
            cl.widths[k] = w
        return
    _, code, specs, scalar = desc
    keys = [_operand(cl, st, j, kind, w, leaf_exprs) for kind, j, w in specs]
    dst = ("val", st.index, 0)
    cl.widths[dst] = specs[0][2]
    cl.ops.append((code, dst, keys[0], keys[1] if len(keys) > 1 else None, 0.0 if scalar is None else scalar))


def _operand(cl, st, j, kind, width, leaf_exprs):
    """The slot key of leaf ``j`` of ``st`` in ``cl`` (a member's value, or a new operand)."""
    ref = st.refs[j]
    key = _key(ref)
    if kind == "v" and (key in cl.widths):
        return key  # computed in the cluster (or a view of it)
    if kind in ("g", "q"):
        key = ("gathered", kind) + key
    elif kind == "v":
        kind = "b"
    if key not in cl.operand_info:
        cl.operand_keys.append(key)
        cl.operand_info[key] = (leaf_exprs[j], kind, width)
        cl.widths[key] = width
    return key


def _finish(cl, consumers, outside_read) -> bool:
    """Outputs, rematerialised chunks, slots and the kernel of a closed cluster (False: not worth
    one, or not one this stage can run)."""
    members = set(cl.members)

    def read_outside(key):
        if key in outside_read:
            return True
        return any(c not in members for c in consumers.get((key[1], key[2]), ()))

    wanted = {op[1] for op in cl.ops if read_outside(op[1])}
    remat = []
    for idx in cl.members:
        pieces = [k for k in cl.views if k[1] == idx]
        if pieces and any(read_outside(k) for k in pieces):
            parent = cl.views[pieces[0]][0]
            if parent in cl.views:
                return False  # pieces of a piece read outside: run as lowered
            if parent not in cl.operand_info:
                wanted.add(parent)  # the pieces are taken again from the kernel's output
            remat.append(idx)
    if not wanted:
        return False  # nothing computed is read outside (dead steps, chunks of operands only)
    # slots: operands, then views (after their parents) and computed values in op order; the
    # outputs numbered in that order too (the kernel's rule)
    slot: dict = {}
    slots = []
    for i, k in enumerate(cl.operand_keys):
        slot[k] = len(slots)
        slots.append((IN, i, cl.widths[k], 0))

    def ensure(k):
        if k in slot:
            return slot[k]
        parent, off = cl.views[k]
        p = ensure(parent)
        slot[k] = len(slots)
        slots.append((VIEW, p, cl.widths[k], off))
        return slot[k]

    ops = []
    outputs = []
    for code, dst, a, b, sc in cl.ops:
        ia = ensure(a)
        ib = ensure(b) if b is not None else -1
        slot[dst] = len(slots)
        if dst in wanted:
            slots.append((OUT, len(outputs), cl.widths[dst], 0))
            outputs.append(dst)
        else:
            slots.append((SCRATCH, 0, cl.widths[dst], 0))
        ops.append((code, slot[dst], ia, ib, float(sc)))
    kernel = _fused.Kernel(slots, ops, len(cl.operand_keys), len(outputs))
    kinds = [cl.operand_info[k][1] for k in cl.operand_keys]
    cl.operands = [cl.operand_info[k][0] for k in cl.operand_keys]
    cl.outputs = outputs
    cl.remat = remat
    cl.call = FusedCall(kernel, kinds, [cl.operand_info[k][2] for k in cl.operand_keys],
                        [cl.widths[k] for k in outputs], len(cl.members))
    return True


def segment_sum(x, seg, n):
    """``(n, W)`` sums of the float32 rows ``x`` ``(R, W)`` per segment id ``seg`` ``(R,)`` int64,
    added in row order as ``index_add_`` adds them on the CPU (the same bits), in one C loop; None
    where that does not apply (another dtype, device or layout, autograd, no extension)."""
    if (_fused is None or _fwad._current_level >= 0 or type(x) is not _T or not _plain_f32(x, torch.is_grad_enabled())
            or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1) or not _row_ids(seg, x.shape[0])):
        return None
    try:
        ptrs = x.data_ptr(), seg.data_ptr()
    except RuntimeError:  # no storage: a torch.func wrapper (vmap's batched tensor)
        return None
    if not x.shape[1]:
        return x.new_zeros((n, 0))
    out = x.new_empty((n, x.shape[1]))  # (seg_sum zeroes it)
    _fused.seg_sum(out.data_ptr(), ptrs[0], ptrs[1], x.shape[0], x.shape[1], x.stride(0), n)
    return out


__all__ = ["plan", "Cluster", "FusedCall", "COUNTS", "available", "segment_sum"]
