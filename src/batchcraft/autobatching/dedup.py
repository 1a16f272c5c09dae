"""Deduplication: a group whose per-instance inputs are integer scalars runs once per distinct input.

Many nodes of a flush call the same static block with the same token ids: a TreeLSTM's per-node
input projections (``W x`` of a word and a UPOS embedding) form one group of every node, and a
batch of 64 UD EWT dev sentences has 1,326 nodes but 587 distinct (word, tag) pairs. The block's
outputs depend only on those integers and the shared tensors (parameters), so the group runs on
the distinct inputs and each node reads its input's row: common-subexpression elimination across
instances, done per flush (nothing is cached across calls, so a parameter changed between calls,
even through ``.data``, is always read).

Applies where (checked once per program, :func:`eligible`):

* every per-instance input is a 0-dim integer tensor (``torch.tensor(word_id)``) and there are no
  list arguments;
* the program makes no random draw (dropout in training mode, ``rand*``, ``bernoulli``,
  ``normal``, ``rrelu``...): a draw per node would differ. Names are checked when the program
  is lowered, and its first deduplicated run checks that the default generator did not move;
* it has no batch norm (in training mode its running statistics count every row);
* it does real arithmetic (a matrix product or convolution): for a lookup alone the extra
  ``unique`` and gather cost more than they save.

and, per group, where no output requires grad (inference), the group has at least
:data:`MIN_NODES` nodes and at most :data:`MAX_DISTINCT` of its rows are distinct. Values are
those of the same rows computed in the full group (the same operations on the same inputs; a
matrix product's rounding may differ in the last bit with the number of rows, as between any two
batch sizes).
"""

from __future__ import annotations

import torch

from batchcraft.autobatching.program import draws

#: groups smaller than this run as they are
MIN_NODES = 32
#: run deduplicated only when at most this fraction of the rows is distinct
MAX_DISTINCT = 0.85

_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_HEAVY = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "einsum", "bilinear", "conv",
          "lstm", "gru", "rnn", "attention")


def _walk(prog):
    todo = [prog]
    while todo:
        p = todo.pop()
        for st in p.steps:
            yield st
            if st.info is not None and st.info.program is not None:
                todo.append(st.info.program)


def eligible(prog, in_descs) -> bool:
    """True when groups running ``prog`` may run deduplicated (see the module docstring).

    ``in_descs``: the ``(shape, dtype, device)`` of each per-instance input.
    """
    if prog.n_ragged or prog.n_in == 0 or len(in_descs) != prog.n_in:
        return False
    if any(d[0] != () or d[1] not in _INT_DTYPES or torch.device(d[2]).type != "cpu" for d in in_descs):
        return False  # (on a GPU the ranges would be read with a sync that stalls recording)
    heavy = False
    for st in _walk(prog):
        name = st.name.lower()
        if draws(st) or "batch_norm" in name:  # (train-mode batch norm updates running stats per row)
            return False
        if any(h in name for h in _HEAVY):
            heavy = True
    return heavy


def distinct(ins):
    """``(unique inputs, inverse)`` of per-node integer inputs ``ins`` (each ``(n,)``), or None.

    The inputs are combined into one int64 key per node (mixed radix over each input's range), so
    one ``torch.unique`` finds the distinct tuples; None when the ranges do not fit in 62 bits.
    """
    los, spans = [], []
    total = 1
    for x in ins:
        lo, hi = int(x.min()), int(x.max())
        span = hi - lo + 1
        total *= span
        if total >= 1 << 62:
            return None
        los.append(lo)
        spans.append(span)
    key = None
    for x, lo, span in zip(ins, los, spans):
        x = x.to(torch.int64)
        x = x - lo if lo else x
        key = x if key is None else key * span + x
    u, inv = torch.unique(key, sorted=False, return_inverse=True)
    cols = []
    for x, lo, span in zip(reversed(ins), reversed(los), reversed(spans)):
        c = u % span if len(ins) > 1 else u
        u = u // span if len(ins) > 1 else u
        c = c + lo if lo else c
        cols.append(c.to(x.dtype))
    return cols[::-1], inv


#: :func:`run`'s answer when the program drew random numbers: never deduplicate it again
DREW = "drew"


def run(runner, n: int, ins, probe: bool = False):
    """``(outputs, rows, rows saved)``: ``runner``'s outputs computed once per distinct input of
    the ``n`` nodes with inputs ``ins`` (each ``(distinct, ...)``), and ``rows`` (``(n,)`` int64),
    the row of each node's input among them; None when too few rows repeat (the caller runs the
    group as it is). The nodes are placed at those rows: no copy per node (a consumer's gather,
    or a fused kernel reading through the index, takes its rows from the distinct outputs).

    ``probe``: the program's first deduplicated run also checks that the default generator's
    state did not move: a random draw the name test missed (an operation that samples under
    another name) would give equal inputs equal draws. Then :data:`DREW` is returned and the
    caller runs the whole group (its draws per node) and stops deduplicating the program.
    """
    got = distinct(ins)
    if got is None:
        return None
    uins, inv = got
    nu = uins[0].shape[0]
    if nu > MAX_DISTINCT * n:
        return None
    before = torch.default_generator.get_state() if probe else None
    outs = runner(nu, uins, [], [], [])
    if probe and not torch.equal(before, torch.default_generator.get_state()):
        return DREW
    return outs, inv, n - nu


__all__ = ["eligible", "distinct", "run", "DREW", "MIN_NODES", "MAX_DISTINCT"]
