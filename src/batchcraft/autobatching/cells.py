"""Recurrent cells split into their input projection and their recurrent part.

``nn.LSTMCell``, ``nn.GRUCell`` and ``nn.RNNCell`` call ``torch.lstm_cell`` (and friends), which
computes ``linear(x, W_ih, b_ih) + linear(h, W_hh, b_hh)`` and the gates in one ATen call. Inside
``autobatch`` such a call is recorded as two operations: the input projection
``F.linear(x, W_ih, b_ih)``, which depends on ``x`` only, and :func:`lstm_gates` (or the GRU / RNN
form) on the projection and the state. Then

* the projections of all time steps and all instances can run as one matrix multiply (the
  scheduler hoists work whose inputs are ready early, :mod:`hoist`), and both matrix multiplies
  go through the kernel selector (:mod:`kernels`);
* a cell whose state is created inside a static block (``torch.zeros(H)``, the same for every
  instance) batches: the state broadcasts over the batch like any shared operand.

The arithmetic is ATen's, in ATen's order (``aten/src/ATen/native/RNN.cpp``), so results agree
with the fused call within float32 rounding.
"""

from __future__ import annotations

import torch

from batchcraft.autobatching import modcalls as _modcalls, stack as _stack
# the input projection: torch's linear (the fused cell calls never go through ``F.linear``, so a
# replacement of it must not apply here)
from batchcraft.autobatching.kernels import TORCH_LINEAR as _LINEAR
from batchcraft.autobatching.patches import PatchSet, SharedPatch

_tf_len, _tf_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_tf_pop, _tf_push = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack

CELL_FUNCS = (torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell)


def lstm_gates(gi, h, c, w_hh, b_hh=None, linear=_LINEAR, fused=False):
    """LSTM cell from its input projection ``gi`` (..., 4H): ``(h', c')``, each (..., H).

    ``fused``: run the elementwise part as one C kernel where it applies (batched programs with
    fusion on, :func:`fused_gates`); otherwise, and wherever the kernel declines, torch's calls."""
    gh = linear(h, w_hh, b_hh)
    if fused:
        out = fused_gates("lstm", gi, gh, c)
        if out is not None:
            return out[1], out[0]
    gates = gi + gh
    i, f, g, o = gates.chunk(4, -1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    c2 = f * c + i * g
    return o * c2.tanh(), c2


def gru_gates(gi, h, w_hh, b_hh=None, linear=_LINEAR, fused=False):
    """GRU cell from its input projection ``gi`` (..., 3H): ``h'`` (..., H). ``fused``: as
    :func:`lstm_gates`."""
    gh = linear(h, w_hh, b_hh)
    if fused:
        out = fused_gates("gru", gi, gh, h)
        if out is not None:
            return out[0]
    ir, iz, inn = gi.chunk(3, -1)
    hr, hz, hn = gh.chunk(3, -1)
    r = (hr + ir).sigmoid()
    z = (hz + iz).sigmoid()
    n = (inn + hn * r).tanh()
    return (h - n) * z + n


def fused_gates(kind: str, gi, gh, state):
    """The elementwise gates of a batch of GRU (``kind="gru"``) or LSTM cells in one C kernel
    (:func:`batchcraft.autobatching.fuse.gates_call`): ``[h']`` or ``[c', h']``, each shaped as
    ``gi`` with H columns; None where it does not apply (no extension, shapes other than rows of
    ``gi``/``gh`` (..., kH) and a state of the same rows or one shared (H,) row, autograd, another
    dtype or device: the kernel's own checks), and the caller computes with torch's calls.
    Within a few float32 units in the last place of torch's sigmoid / tanh (``fuse``)."""
    global _fuse
    if _fuse is None:
        from batchcraft.autobatching import fuse as _f
        _fuse = _f
    if not (type(gi) is _T and type(gh) is _T and isinstance(state, _T)):
        return None
    lead = gi.shape[:-1]
    H = state.shape[-1] if state.dim() else 0
    k = 3 if kind == "gru" else 4
    if H == 0 or gh.shape != gi.shape or gi.shape[-1] != k * H or state.dim() > gi.dim():
        return None
    if state.shape[:-1] == lead:
        shared = False
    elif state.numel() == H:
        shared = True
    else:
        return None  # a state broadcast another way: torch's calls
    fc = _fuse.gates_call(kind, H, shared)
    if fc is None:
        return None
    rows = gi.numel() // (k * H)
    outs = fc(rows, None, gi.reshape(rows, k * H), gh.reshape(rows, k * H),
              state.reshape(H) if shared else state.reshape(rows, H))
    if outs is None:
        return None
    return [o.view(*lead, H) for o in outs]


_fuse = None
_T = torch.Tensor


def rnn_tanh_gates(gi, h, w_hh, b_hh=None, linear=_LINEAR):
    return (gi + linear(h, w_hh, b_hh)).tanh()


def rnn_relu_gates(gi, h, w_hh, b_hh=None, linear=_LINEAR):
    return (gi + linear(h, w_hh, b_hh)).relu()


GATES = (lstm_gates, gru_gates, rnn_tanh_gates, rnn_relu_gates)


def record_cell(rec, func, args, kwargs):
    """Record a cell call as projection + gates; NotImplemented when it is not the plain form."""
    if kwargs or len(args) < 4:
        return NotImplemented
    x, hx, w_ih, w_hh = args[:4]
    b_ih = args[4] if len(args) > 4 else None
    b_hh = args[5] if len(args) > 5 else None
    if type(x) is not rec.lazy_type or not all(isinstance(w, torch.Tensor) and type(w) is not rec.lazy_type
                                               for w in (w_ih, w_hh) + tuple(b for b in (b_ih, b_hh) if b is not None)):
        return NotImplemented
    states = tuple(hx) if func is torch.lstm_cell and isinstance(hx, (tuple, list)) else (hx,)
    if (func is torch.lstm_cell and len(states) != 2) or not _shapes_ok(x, states, w_ih, w_hh, rec.lazy_type, 2):
        return NotImplemented  # recorded as the fused call, whose shape check raises ATen's error
    if func is torch.lstm_cell:
        gi = rec.record(_LINEAR, (x, w_ih, b_ih), {})
        return rec.record(lstm_gates, (gi, hx[0], hx[1], w_hh, b_hh), {})
    gates = {torch.gru_cell: gru_gates, torch.rnn_tanh_cell: rnn_tanh_gates, torch.rnn_relu_cell: rnn_relu_gates}[func]
    gi = rec.record(_LINEAR, (x, w_ih, b_ih), {})
    return rec.record(gates, (gi, hx, w_hh, b_hh), {})


def _shapes_ok(x, states, w_ih, w_hh, lazy_type, rank=None) -> bool:
    """ATen's cell checks (``check_rnn_cell_forward_input/hidden``) on rows of equal rank:
    input (..., in) with in = w_ih's columns; each state (..., hidden) with the input's leading
    size. Reads shapes only (no recorded operation)."""
    with torch._C.DisableTorchFunction():
        shapes = [tuple(t.shape) if type(t) is lazy_type or isinstance(t, torch.Tensor) else None
                  for t in (x, *states)]
        w_in, hidden = w_ih.shape[1], w_hh.shape[1]
    xs = shapes[0]
    if xs is None or len(xs) not in ((rank,) if rank else (1, 2)) or xs[-1] != w_in:
        return False
    return all(s is not None and len(s) == len(xs) and s[-1] == hidden and s[:-1] == xs[:-1] for s in shapes[1:])


def rule_gates(func, struct, leaves, mask, shapes, n):
    """The gate functions act on the last dimension: a direct call batches them (states created
    per call broadcast); lower-rank batched operands are aligned as in elementwise operations."""
    from batchcraft.autobatching.signature import call_with

    rank = max((len(s) for s, m in zip(shapes, mask) if m), default=1)
    new = [x.reshape((n,) + (1,) * (rank - len(s)) + tuple(s)) if m and len(s) < rank else x
           for x, m, s in zip(leaves, mask, shapes)]
    return call_with(func, struct, new)


def lower_gates(func, args, kwargs, lw):
    """Lowered gates: the recurrent matrix multiply through the kernel selector."""
    rank = max((len(s) for s, b in zip(lw.shapes, lw.batched) if b), default=1)
    for j, (b, s) in enumerate(zip(lw.batched, lw.shapes)):
        if b and len(s) < rank:
            lw.wrap(j, lambda e, s=s: f"{e}.reshape((n,) + {(1,) * (rank - len(s)) + tuple(s)!r})")
    if lw.kernels is not None:
        kwargs = dict(kwargs, linear=lw.kernels.linear_for(lw, lw.shapes))
    if lw.fuse and func in (gru_gates, lstm_gates):
        kwargs = dict(kwargs, fused=True)
    return lw.call(func, args, kwargs)


# -- cell modules called on lazy values --------------------------------------------------------
# ``nn.GRUCell.forward`` is Python: dimension checks, an ``unsqueeze`` of input and state, the
# fused ATen call, a ``squeeze`` -- five recorded operations and about 14 us per call inside
# ``autobatch``, more than eager's whole step. While a call records, :data:`FAST_CELLS` makes the
# three cell classes' ``forward`` record projection + gates directly (two operations, on 1-D
# rows as they are). Anything else (no active recorder, a static block's tracer, an input that
# is not this call's lazy value, a state missing or of another rank, a subclass's own forward)
# runs the original forward, unchanged.

_MISSING = object()
_NO_PARAMS: dict = {}


def _plain_tensor(t, lazy_type) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is not lazy_type




def _fast_cell(original, n_states, gates_of):
    """A cell class's ``forward`` that records projection + gates on this call's lazy values."""
    def forward(self, input, hx=None):
        rec = _stack.current()
        lazy_type = getattr(rec, "lazy_type", None)
        if (lazy_type is None or type(input) is not lazy_type or input.rec is not rec
                or getattr(rec, "is_tracer", False) or hx is None):
            return original(self, input, hx)
        if n_states == 1:  # GRU / RNN: a state tensor, not a sequence (torch raises for one)
            if isinstance(hx, (tuple, list)):
                return original(self, input, hx)
            states = (hx,)
        else:
            if not isinstance(hx, (tuple, list)):
                return original(self, input, hx)
            states = tuple(hx)
        # the registered parameters themselves (one dict read each, not four __getattr__ calls);
        # a parametrized or replaced weight is not there: torch's forward then reads it its way
        d = self.__dict__
        cls = type(self)
        if ("weight_ih" in d or "weight_hh" in d or "bias_ih" in d or "bias_hh" in d
                or not _modcalls.class_calls_own(cls, _modcalls.CELL_PARAMS, _modcalls.CELL_VERDICTS)):
            return original(self, input, hx)  # the forward reads its weights another way
        params = d.get("_parameters") or _NO_PARAMS
        w_ih, w_hh = params.get("weight_ih", _MISSING), params.get("weight_hh", _MISSING)
        b_ih, b_hh = params.get("bias_ih", _MISSING), params.get("bias_hh", _MISSING)
        gates = gates_of(self)
        # this call's checks passed before for the same module, weights, gates and input / state
        # descriptors (shapes, dtypes): the checks read shapes only, so they pass again
        if n_states == 1:
            key = (id(self), gates, input.did, hx.did if type(hx) is lazy_type else None)
        else:
            key = (id(self), gates, input.did, *[t.did if type(t) is lazy_type else None for t in states])
        checked = _checked(rec)
        seen = checked.get(key)
        if seen is None or seen[0] is not w_ih or seen[1] is not w_hh or seen[2] is not b_ih or seen[3] is not b_hh:
            weights = (w_ih, w_hh, b_ih, b_hh)
            if (gates is None or len(states) != n_states
                    or any(w is _MISSING or (w is not None and not _plain_tensor(w, lazy_type)) for w in weights)
                    or w_ih is None or w_hh is None or not _shapes_ok(input, states, w_ih, w_hh, lazy_type)):
                return original(self, input, hx)  # torch's forward: its own checks and errors
            if None not in key[3:]:
                checked[key] = weights  # holds the weights: their ids stay theirs
        # as mode.as_mode_handler (inlined: the hot path of plain recurrent models)
        mode = rec.mode
        n = _tf_len()
        if mode is None or not n or _tf_at(n - 1) is not mode:
            return original(self, input, hx)  # a mode of the user's is innermost: it sees torch's calls
        _tf_pop()
        try:
            return rec.record(gates, (rec.record(_LINEAR, (input, w_ih, b_ih), {}), *states, w_hh, b_hh), {})
        finally:
            _tf_push(mode)

    forward.__wrapped__ = original
    forward.__doc__ = original.__doc__
    return forward


def _checked(rec) -> dict:
    """Cell calls whose checks passed during this recorder's call (dropped with the recorder)."""
    d = rec.__dict__
    c = d.get("_cells_checked")
    if c is None:
        c = d["_cells_checked"] = {}
    return c


def _rnn_gates(cell):
    return {"tanh": rnn_tanh_gates, "relu": rnn_relu_gates}.get(cell.nonlinearity)  # else: torch's error


def _fast_modules():
    from torch import nn

    patches = []
    # fixed gates are handed to the C core's __call__ (modcalls.cell_call), which then records the
    # forward's common case itself; RNNCell's depend on its nonlinearity: the Python forward decides
    for cls, n_states, gates_of, fixed in ((nn.LSTMCell, 2, lambda cell: lstm_gates, lstm_gates),
                                           (nn.GRUCell, 1, lambda cell: gru_gates, gru_gates),
                                           (nn.RNNCell, 1, _rnn_gates, None)):
        if not _modcalls.torch_own(cls.forward):  # wrapped before batchcraft's import: theirs runs
            continue
        forward = _fast_cell(cls.forward, n_states, gates_of)
        patches += [SharedPatch(cls, "forward", forward),
                    SharedPatch(cls, "__call__", _modcalls.cell_call(cls, forward, fixed, n_states))]
    return patches


#: enter/exit around a recording call: the cell modules' forward records directly, and their
#: ``__call__`` skips ``Module.__call__`` when nothing would make it differ (modcalls.py)
FAST_CELLS = PatchSet(_fast_modules())

__all__ = ["CELL_FUNCS", "GATES", "record_cell", "lstm_gates", "gru_gates", "FAST_CELLS"]
