"""Hoisting: run the part of a signature that depends only on early inputs once, for all depths.

A static block such as ``static_block(nn.LSTMCell)`` is one node per time step: the nodes of step
t of all instances form one group, and the input projection ``x_t W_ih^T`` inside runs as one
matrix multiply per step. But ``x_t`` (an embedding) is ready long before step t runs. When a
signature has groups at several depths and some of its inputs are ready before its first group
(their producers are computed, or sit at least one level earlier), the program is split
(:func:`split`): the prefix P of steps computable from those inputs and shared tensors runs once
for every node of the signature (one large matrix multiply instead of one per step), and each
group runs the rest R with its rows of P's outputs (a contiguous slice: P's rows follow the
groups' order). Only worth it when P holds a matrix multiply, embedding or convolution.

This is the loop-invariant hoisting a compiler does, across instances and time steps; ACRoBat
gets the same effect from its static analysis of the per-instance program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchcraft.autobatching.program import Program, Step
from batchcraft.autobatching.kernels import TORCH_LINEAR as _LINEAR

HEAVY = {_LINEAR, torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__,
         F.embedding, torch.embedding, F.conv1d, F.conv2d, F.bilinear}


class Split:
    """A program split into a prefix (early inputs only) and the rest.

    Attributes:
        early (tuple[int]): the single input slots P reads.
        prefix (Program): inputs = those slots (in order); outputs = the values R needs.
        rest (Program): inputs = the original single inputs, then P's outputs.
        rest_reads (tuple[bool]): per original single input, whether R reads it (an input only
            P reads, such as the ``x`` of a hoisted input projection, is not gathered per group).
    """

    def __init__(self, early, prefix, rest):
        self.early = early
        self.prefix = prefix
        self.rest = rest
        read = {r[1] for st in rest.steps for r in st.refs if r[0] == "in"}
        read |= {r[1] for r in rest.out_refs if r[0] == "in"}
        self.rest_reads = tuple(j in read for j in range(rest.n_in - len(prefix.out_refs)))


def _heavy(st) -> bool:
    if st.func in HEAVY:
        return True
    info = st.info
    return info is not None and info.program is not None and any(_heavy(s) for s in info.program.steps)


def split(prog: Program, early: tuple):
    """Split ``prog`` on the input slots ``early``; None when the prefix would hold no heavy step."""
    if prog.n_ragged or not early or len(early) == prog.n_in:
        return None
    early_set = set(early)
    in_prefix = set()
    for st in prog.steps:
        ok = True
        for ref in st.refs:
            if ref[0] == "in" and ref[1] not in early_set:
                ok = False
            elif ref[0] == "val" and ref[1] not in in_prefix:
                ok = False
            elif ref[0] == "ragged":
                ok = False
        if ok and any(r[0] != "const" for r in st.refs):
            in_prefix.add(st.index)
    if not any(_heavy(prog.steps[k]) for k in in_prefix):
        return None
    # values of the prefix that the rest (or the outputs) read
    needed = []
    for st in prog.steps:
        if st.index in in_prefix:
            continue
        for ref in st.refs:
            if ref[0] == "val" and ref[1] in in_prefix and (ref[1], ref[2]) not in needed:
                needed.append((ref[1], ref[2]))
    for ref in prog.out_refs:
        if ref[0] == "val" and ref[1] in in_prefix and (ref[1], ref[2]) not in needed:
            needed.append((ref[1], ref[2]))
    if not needed:
        return None
    early_pos = {j: i for i, j in enumerate(early)}
    # prefix program: steps renumbered, inputs renumbered to the early slots' order
    pmap, psteps = {}, []
    for st in prog.steps:
        if st.index not in in_prefix:
            continue
        k = len(psteps)
        pmap[st.index] = k
        refs = [("in", early_pos[r[1]]) if r[0] == "in" else (("val", pmap[r[1]], r[2]) if r[0] == "val" else r)
                for r in st.refs]
        psteps.append(Step(k, st.func, st.struct, refs, st.dids, st.batched, st.out_struct, st.out_dids, st.out_rg,
                           st.state, st.info))
    out_refs = [("val", pmap[k], s) for k, s in needed]
    out_dids = [prog.steps[k].out_dids[s] for k, s in needed]
    out_rg = [prog.steps[k].out_rg[s] for k, s in needed]
    prefix = Program(psteps, out_refs, ("list", None), out_dids, out_rg, len(early), name=f"{prog.name}[hoisted]")
    # the rest: prefix values become extra single inputs
    extra = {kv: prog.n_in + i for i, kv in enumerate(needed)}
    rmap, rsteps = {}, []

    def remap(r):
        if r[0] == "val":
            if r[1] in in_prefix:
                return ("in", extra[(r[1], r[2])])
            return ("val", rmap[r[1]], r[2])
        return r

    for st in prog.steps:
        if st.index in in_prefix:
            continue
        k = len(rsteps)
        rmap[st.index] = k
        rsteps.append(Step(k, st.func, st.struct, [remap(r) for r in st.refs], st.dids, st.batched, st.out_struct,
                           st.out_dids, st.out_rg, st.state, st.info))
    rest = Program(rsteps, [remap(r) for r in prog.out_refs], prog.out_struct, prog.out_dids, prog.out_rg,
                   prog.n_in + len(needed), name=f"{prog.name}[rest]")
    return Split(tuple(early), prefix, rest)


def run_prefix(executor, sp, nodes):
    """Run the prefix of split ``sp`` for all ``nodes`` at once; its outputs, rows in node order."""
    from batchcraft.autobatching.gather import take

    rec = executor.rec
    plans = rec.plan_slots(nodes, sp.early)
    ins = [take(rec.buffers, p) for p in plans]
    return executor.runner_for(sp.prefix)(len(nodes), ins)


def plan(rec, prog, groups):
    """Which split (or None) to use for one signature's ``groups`` (lists of nodes) in this flush."""
    if prog.n_ragged or prog.n_in < 2 or len(groups) < 2:
        return None
    nodes = [nd for g in groups for nd in g]
    mind, deep = rec.input_depths(nodes, prog.n_in)
    # the prefix runs just before the signature's first group: inputs produced at a lower depth
    # are computed by then
    early = tuple(j for j in range(prog.n_in) if deep[j] < mind)
    if not early or len(early) == prog.n_in:
        return None
    cache = prog.lowered.setdefault("splits", {})
    if early not in cache:
        cache[early] = split(prog, early)
    return cache[early]


__all__ = ["split", "plan", "Split", "HEAVY"]
