"""Node order inside groups: recurrences in packed order, so steps read their state as views.

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


__all__ = ["packed_order", "MIN_NODES"]
