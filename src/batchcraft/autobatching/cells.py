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
import torch.nn.functional as F

CELL_FUNCS = (torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell)


def lstm_gates(gi, h, c, w_hh, b_hh=None, linear=F.linear):
    """LSTM cell from its input projection ``gi`` (..., 4H): ``(h', c')``, each (..., H)."""
    gates = gi + linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, -1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    c2 = f * c + i * g
    return o * c2.tanh(), c2


def gru_gates(gi, h, w_hh, b_hh=None, linear=F.linear):
    """GRU cell from its input projection ``gi`` (..., 3H): ``h'`` (..., H)."""
    ir, iz, inn = gi.chunk(3, -1)
    hr, hz, hn = linear(h, w_hh, b_hh).chunk(3, -1)
    r = (hr + ir).sigmoid()
    z = (hz + iz).sigmoid()
    n = (inn + hn * r).tanh()
    return (h - n) * z + n


def rnn_tanh_gates(gi, h, w_hh, b_hh=None, linear=F.linear):
    return (gi + linear(h, w_hh, b_hh)).tanh()


def rnn_relu_gates(gi, h, w_hh, b_hh=None, linear=F.linear):
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
    if func is torch.lstm_cell:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            return NotImplemented
        gi = rec.record(F.linear, (x, w_ih, b_ih), {})
        return rec.record(lstm_gates, (gi, hx[0], hx[1], w_hh, b_hh), {})
    gates = {torch.gru_cell: gru_gates, torch.rnn_tanh_cell: rnn_tanh_gates, torch.rnn_relu_cell: rnn_relu_gates}[func]
    gi = rec.record(F.linear, (x, w_ih, b_ih), {})
    return rec.record(gates, (gi, hx, w_hh, b_hh), {})


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
    return lw.call(func, args, kwargs)


__all__ = ["CELL_FUNCS", "GATES", "record_cell", "lstm_gates", "gru_gates"]
