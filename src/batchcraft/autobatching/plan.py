"""Gather plans: where the rows of one argument of a group come from.

For a group of ``n`` nodes and one of its input slots, the rows are ``(buffer, row)`` pairs
(buffers are the batched results of earlier groups, arenas, and stacked leaves). A plan says
how to assemble them into one ``(n, ...)`` tensor with the fewest copies:

* ``("view", buf, r0, n)``: rows ``r0 .. r0+n-1`` of one buffer, in order: a view, no copy;
* ``("index", buf, rows)``: rows of one buffer: one ``index_select``;
* ``("multi", [(buf, rows), ...], perm)``: rows of several buffers: one piece per buffer, one
  ``cat``, then ``perm`` (or None when the pieces are already in order).

``rows`` and ``perm`` are sequences of ints or little-endian int64 ``bytes`` (the C core's
planner emits bytes). This module is the reference planner; the C core implements the same.
"""

from __future__ import annotations


def plan_rows(bufs, rows):
    """The plan for rows ``rows[i]`` of buffers ``bufs[i]``."""
    n = len(rows)
    b0 = bufs[0]
    for b in bufs:
        if b != b0:
            break
    else:
        r0 = rows[0]
        if rows[-1] - r0 == n - 1:
            for i in range(n):
                if rows[i] != r0 + i:
                    break
            else:
                return ("view", b0, r0, n)
        return ("index", b0, rows)
    index: dict = {}
    pieces: list = []
    order = []
    for b, r in zip(bufs, rows):
        k = index.get(b)
        if k is None:
            k = index[b] = len(pieces)
            pieces.append((b, []))
        lst = pieces[k][1]
        order.append((k, len(lst)))
        lst.append(r)
    offsets, acc = [], 0
    for _, lst in pieces:
        offsets.append(acc)
        acc += len(lst)
    perm = [offsets[k] + j for k, j in order]
    if perm == list(range(n)):
        perm = None
    return ("multi", pieces, perm)
