"""Node order inside groups: rows laid out in the order their readers read them, so gathers are views.

Two orders, both applied by the depth scheduler before a flush runs:

* **packed order** (:func:`packed_order`), for recurrences, described below;
* **consumer order** (:func:`consumer_order`), for a signature that runs as one group in the
  flush (TreeLSTM's per-node input projections: one group of every node, read by the cell groups
  of every depth). Its nodes are ordered by their readers: first those the first later group
  reads, in that group's node order, then those the next group reads, and so on. Each reader then
  takes its rows as a contiguous view instead of an ``index_select`` (ISSUE 14, "layout without
  gathers"; the prototype of REFERENCES §7 lays rows out in consumer order the same way).

A recurrence (a cell called once per time step: BiRNN's ``cell(x_t, (h, c))``) is one signature
with one group per depth, each instance at most once per group. Its instances stop at different
steps. The rows of a group follow its node order, and by default that is the instance order, so
the instances still running at step t+1 are scattered among step t's rows: every step gathers
its state with an ``index_select``. Ordered by the number of steps each instance has in the flush
(longest first, then by instance), the instances of step t+1 are the first rows of step t, and
each step reads its state as a contiguous view of the previous step's rows (with the output
arenas of :mod:`execute`, of the shared arena). This is the order of a packed sequence
(``torch.nn.utils.rnn.pack_sequence`` sorts by length for the same reason); DyNet and ACRoBat
gather instead.

The nodes of a group are independent, so any order computes the same values; only the row each
node's outputs land in changes, and the recorder's placement follows the order given.
"""

from __future__ import annotations

#: signatures with fewer nodes in a flush keep their order (sorting costs more than it saves)
MIN_NODES = 32


def packed_order(rec, groups) -> int:
    """Reorder, in place, the node lists of ``groups`` (``[(key, nodes), ...]``, key =
    ``(phase, depth, sid)``) of every recurrence: signatures with groups at two or more depths
    and no instance twice in one group. Returns the number of groups reordered."""
    by_sig: dict = {}
    for key, nodes in groups:
        by_sig.setdefault((key[0], key[2]), []).append(nodes)
    done = 0
    for lists in by_sig.values():
        if len(lists) < 2 or sum(len(g) for g in lists) < MIN_NODES:
            continue
        insts = [rec.group_instances(g) for g in lists]
        if any(len(set(ig)) != len(ig) for ig in insts):
            continue  # a tree cell: several nodes of one instance per depth
        steps: dict = {}
        for ig in insts:
            for i in ig:
                steps[i] = steps.get(i, 0) + 1
        for g, ig in zip(lists, insts):
            order = sorted(range(len(g)), key=lambda j: (-steps[ig[j]], ig[j]))
            if any(j != k for k, j in enumerate(order)):
                g[:] = [g[j] for j in order]
                done += 1
    return done


def consumer_order(rec, groups, placed_by_rows=None) -> int:
    """Reorder, in place, the node lists of ``groups`` (``[(key, nodes), ...]`` in execution
    order) of each signature that has one group in the flush, by their readers (see above).

    Only reads through single (non-list) arguments count; list arguments (a node's children) are
    flat member rows ordered by their segment. Signatures with groups at several depths (cells,
    recurrences) keep their order: packed order and the output arenas place those. Groups for
    which ``placed_by_rows(key, n)`` is true are left alone: a deduplicated group places each
    node at its distinct input's row, whatever the node order. Returns the number of groups
    reordered.
    """
    count: dict = {}
    for key, _ in groups:
        sig = (key[0], key[2])
        count[sig] = count.get(sig, 0) + 1
    eligible = [count[(key[0], key[2])] == 1 and len(nodes) >= 2
                and not (placed_by_rows is not None and placed_by_rows(key, len(nodes))) for key, nodes in groups]
    if not any(eligible):
        return 0
    return rec.order_by_consumers([nodes for _, nodes in groups], eligible)


__all__ = ["packed_order", "consumer_order", "MIN_NODES"]
