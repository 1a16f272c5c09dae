"""Lowering: a :class:`~batchcraft.autobatching.program.Program` becomes one Python function.

For each step the operation's :class:`~batchcraft.autobatching.rules.Rule` writes the batched
call as an expression (dimension arguments shifted past the batch dimension, ranks aligned,
the matrix-multiply kernel chosen), and the steps are emitted as straight-line source, compiled
once per signature::

    def run(n, I0, I1, R0, S0, C0):      # inputs (n, ...), ragged members, segment ids, counts
        v0_0, v0_1 = K0(I0, W0, B0)
        v1 = v0_0.sigmoid()
        ...
        return [v5, v6_1]

so a group costs its torch calls and little else (ACRoBat generates its batched kernels and host
code ahead of time; this is the same idea at Python level). Runs of elementwise steps then become
one fused C kernel call each (:mod:`fuse`), the steps kept as its fallback branch.

A program is lowered once, into two functions of the same steps, rewrites and fused kernels: a
checked one for its first run, which also checks the shape and dtype of every step it runs
unfused against the per-instance trace, and the same function without the checks for every
later run. A step whose rule fails or disagrees runs one instance at a time from then on
(correct, counted, with the reason), and the program is lowered again. The executor lowers a
program before it gathers its first group (:meth:`Runner.prepare`), so that first run already
reads its inputs in place. (Until stop 52 the first run was a separately lowered program without
fusion or rows in place: a TreeLSTM first call ran 34% more instructions than a steady one; now 20%.)
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import NamedTuple

import torch

from batchcraft.autobatching import fuse as _fuse
from batchcraft.autobatching import rowmm as _rowmm
from batchcraft.autobatching.codecache import compile_program
from batchcraft.autobatching.descs import DESCS
from batchcraft.autobatching.gather import RowRefs, Rows
from batchcraft.autobatching.gather import materialize as _materialize
from batchcraft.autobatching.program import draws
from batchcraft.autobatching.rules import rule_for
from batchcraft.autobatching.signature import LEAF, call_with, flatten, rebuild
from batchcraft.errors import AutobatchError


class _X:
    """A leaf placeholder inside rebuilt arguments: stands for the Python expression ``expr``."""

    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = expr


N = _X("n")


class _LeafX(_X):
    """A leaf placeholder whose expression is read when emitted (after a rule's ``wrap``)."""

    __slots__ = ("j", "lw")

    def __init__(self, j, lw):
        self.j, self.lw = j, lw

    @property
    def expr(self):
        e = self.lw.exprs[self.j]
        w = self.lw._wrapped.get(self.j)
        return w(e) if w is not None else e


class Emitter:
    """Names for the objects a generated function uses (its globals)."""

    def __init__(self):
        self.ns: dict = {"torch": torch}
        self._ids: dict = {}

    def name(self, obj, hint="g") -> str:
        k = id(obj)
        nm = self._ids.get(k)
        if nm is None:
            # "_" first: never one of the program's parameters (n, I0, R0, S0, C0...), whose names a
            # constant named "C0" shadowed (a hostile find at stop 35: the counts became the weight)
            nm = self._ids[k] = f"_{hint}{len(self._ids)}"
            self.ns[nm] = obj
        return nm

    def ns_name(self, obj):
        """The name ``obj`` already has here, or None (named nothing new)."""
        return self._ids.get(id(obj))

    def value(self, v) -> str:
        """A Python expression for ``v`` (a rebuilt argument that may contain placeholders)."""
        t = type(v)
        if t is _X or t is _LeafX:
            return v.expr
        if v is None or t is bool or t is int or t is str:
            return repr(v)
        if t is float:
            return repr(v) if math.isfinite(v) else self.name(v, "f")
        if t is tuple or t is torch.Size:
            items = [self.value(x) for x in v]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if t is list:
            return "[" + ", ".join(self.value(x) for x in v) + "]"
        if t is dict:
            return "{" + ", ".join(f"{k!r}: {self.value(x)}" for k, x in v.items()) + "}"
        if t is slice:
            return f"slice({self.value(v.start)}, {self.value(v.stop)}, {self.value(v.step)})"
        if v is Ellipsis:
            return "..."
        return self.name(v, "c")

    def call(self, func, args, kwargs) -> str:
        parts = [self.value(a) for a in args]
        parts += [f"{k}={self.value(x)}" for k, x in kwargs.items()]
        return f"{self.name(func, 'F')}({', '.join(parts)})"


def leaf_shapes(step) -> list:
    """Per leaf of ``step``: its per-instance shape (a const's own shape)."""
    return [tuple(r[1].shape) if r[0] == "const" else DESCS[d][0] for r, d in zip(step.refs, step.dids)]


class StepView:
    """What a rule's lowering sees of one step: masks, shapes, and how to write expressions."""

    def __init__(self, em, step, exprs, batched, kernels, fuse=False):
        self.em = em
        self.fuse = fuse  # fused elementwise kernels are on for this program (cells' gates use one)
        self.step = step
        self.exprs = list(exprs)
        self.batched = batched
        self.shapes = leaf_shapes(step)
        self.kernels = kernels
        self.N = N
        self._wrapped = {}

    def wrap(self, j, fn) -> None:
        """Emit leaf ``j`` as ``fn(expression)`` (e.g. a reshape that aligns ranks)."""
        self._wrapped[j] = fn

    def expr(self, v) -> str:
        return self.em.value(v)

    def value(self, v) -> str:
        return self.em.value(v)

    def call(self, func, args, kwargs) -> str:
        return self.em.call(func, args, kwargs)


class StepFailed(Exception):
    def __init__(self, index, reason):
        super().__init__(reason)
        self.index = index
        self.reason = reason


def _per_instance(func, struct, batched):
    """A step run one instance at a time on the rows of its batched arguments, stacked."""

    def run(*leaves):
        n = next(x.shape[0] for x, b in zip(leaves, batched) if b)
        per_slot = None
        out_struct = None
        for i in range(n):
            li = [x[i] if b else x for x, b in zip(leaves, batched)]
            out = call_with(func, struct, li)
            flat: list = []
            out_struct = flatten(out, flat, _NoLazy)
            if per_slot is None:
                per_slot = [[] for _ in flat]
            for s, t in enumerate(flat):
                per_slot[s].append(t)
        stacked = [torch.stack(ts) for ts in per_slot]
        return rebuild(out_struct, iter(stacked))

    return run


class _NoLazy:
    pass


class _Shaped(NamedTuple):
    """The shape and dtype of rows not gathered (what :func:`_check` compares)."""

    shape: tuple
    dtype: torch.dtype


class Taken(NamedTuple):
    """The inputs a lowered program takes as rows of their buffers rather than gathered tensors.

    Attributes:
        deferred_ins, deferred_rags (frozenset[int]): inputs / ragged member inputs that only
            fused kernels read: the executor may pass them as
            :class:`~batchcraft.autobatching.gather.Rows`, read in place through their index (the
            unfused branches copy them first).
        rows_ins (frozenset[int]): inputs that only batched products read (:mod:`rowmm`), passed
            as :class:`~batchcraft.autobatching.gather.RowRefs`.
        cut_out (int): the output whose rows past the first ``L`` the program may leave
            uncomputed (NaN) when called with ``live=L`` (:func:`_cut_output`); -1: none.
    """

    deferred_ins: frozenset
    deferred_rags: frozenset
    rows_ins: frozenset
    cut_out: int = -1


NOTHING_TAKEN = Taken(frozenset(), frozenset(), frozenset())


def _conform(ins, rags, taken: Taken):
    """``ins`` and ``rags`` with every row form that ``taken`` does not allow copied into a tensor."""
    ins = [x if (type(x) is Rows and j in taken.deferred_ins) or (type(x) is RowRefs and j in taken.rows_ins)
           else _materialize(x) for j, x in enumerate(ins)]
    rags = [x if type(x) is not Rows or r in taken.deferred_rags else _materialize(x) for r, x in enumerate(rags)]
    return ins, rags


def _check(expected, n, value, batched):
    shape, dtype, _ = DESCS[expected]
    if type(value) is Rows:  # (a ragged stack's value is its member rows, read in place)
        value = _Shaped((value.index.shape[0], *value.buffer.shape[1:]), value.buffer.dtype)
    elif type(value) is RowRefs:
        value = _Shaped((value.addrs.shape[0], *value.shape), torch.float32)
    if batched == "ragged":  # flat member rows: (members, *shape[1:])
        if not isinstance(value, (torch.Tensor, _Shaped)) or tuple(value.shape[1:]) != tuple(shape[1:]):
            return f"ragged shape {tuple(getattr(value, 'shape', ()))}, expected (members, *{tuple(shape[1:])})"
        return None if value.dtype == dtype else f"batched dtype {value.dtype}, expected {dtype}"
    want = (n, *shape) if batched else tuple(shape)
    if not isinstance(value, (torch.Tensor, _Shaped)):
        return f"returned {type(value).__name__}, expected a tensor"
    if tuple(value.shape) != want:
        return f"batched shape {tuple(value.shape)}, expected {want}"
    if value.dtype != dtype:
        return f"batched dtype {value.dtype}, expected {dtype}"
    return None


class Runner:
    """The compiled form of one program (dense, or ragged with :mod:`ragged`'s plan).

    Call: ``runner(n, inputs, ragged_members, segments, counts) -> list`` of the program's
    outputs, each ``(n, *per-instance shape)``.
    Args:
        fuse (bool): the programs (the first run's checked one too) run their elementwise clusters
            as fused C kernels (:mod:`fuse`; option ``fuse_elementwise``).
    Attributes:
        fallbacks (dict[int, str]): steps run one instance at a time, with the reason.
        rules (Counter): which rule each batched step used (for ``RunStats.groups_by_rule``).
        clusters (list[fuse.Cluster]): the fused clusters of the programs.
        fuse_error (str): why planning them failed ("" if it did not; the program then runs unfused).
        lower_error (str): why the program without checks failed to build ("" if it did not; the
            checked one then runs every time).
        unread_ins (frozenset[int]): inputs no step and no output reads (a leaf node's unused
            argument, such as a TreeLSTM leaf's forget-gate input): the executor need not gather them
            and passes None.
        taken (Taken): the inputs the programs take as rows (set when the program is lowered,
            after the programs; :meth:`prepare`); ``deferred_ins``, ``deferred_rags`` and
            ``rows_ins`` read it.
    """

    def __init__(self, program, kernels=None, ragged_plan=None, fuse=False):
        self.program = program
        self.kernels = kernels
        self.ragged_plan = ragged_plan
        self.fuse = fuse
        self.clusters: list = []
        self.fuse_error = ""   # why planning the fused kernels failed (the program then runs unfused)
        self.rewrite_error = ""  # why accumulating products failed (the program then runs as lowered)
        self.lower_error = ""  # why the program without checks failed to build (the checked one serves)
        self.fallbacks: dict = {}
        self.rules: Counter = Counter()
        self._fast = None
        self._checked = None
        self._make_fast = None
        self.unread_ins: frozenset = _unread_inputs(program)
        self.taken = NOTHING_TAKEN  # the inputs the lowered programs take as rows
        self.writes_outputs = False  # a fused kernel computes a program output (__call__'s dest)
        self.source = ""
        self.compiled = None

    def _build(self):
        """Lower the program once; return ``(checked run, fast program, rules, taken)``.

        Both functions run the same lowered steps, rewrites and fused kernels. The checked one
        also wraps each step it runs unfused in a check of its outputs' shapes and dtypes against
        the trace (:func:`_check`; a failure raises :class:`StepFailed`); ``fast()`` compiles the
        one without checks and returns ``(run, source)``. ``taken``: the inputs both take as rows
        (:class:`Taken`). One lowering serves both, so a first call lowers each program once and
        its first run already uses the fused kernels (before, it lowered twice and ran the
        checked program unfused)."""
        prog = self.program
        em = Emitter()
        rules = Counter()
        n_in = prog.n_in
        params = ["n"] + [f"I{j}" for j in range(n_in)]
        if self.ragged_plan is not None:
            params += [f"R{r}" for r in range(prog.n_ragged)]
            params += [f"S{c}" for c in sorted(set(prog.ragged_classes))]
            params += [f"C{c}" for c in sorted(set(prog.ragged_classes))]
        params.append("D=None")  # rows for the program's outputs (see _assemble), or None
        params.append("L=None")  # nodes whose output Taken.cut_out is read (the first L), or None: all
        vals = {}   # (step, slot) -> (expr, batched)
        em.ns["_chk"] = _check
        em.ns["_StepFailed"] = StepFailed

        def leaf_expr(ref):
            kind = ref[0]
            if kind == "in":
                return f"I{ref[1]}", True
            if kind == "ragged":
                return f"R{ref[1]}", True
            if kind == "val":
                return vals[(ref[1], ref[2])]
            return em.name(ref[1], "C"), False

        step_lines: dict = {}
        step_rule: dict = {}
        leaf_exprs: dict = {}
        leaf_batched: dict = {}
        checks: dict = {}  # step -> the lines that check its outputs (the checked run's)
        for st in prog.steps:
            ex, bt = zip(*[leaf_expr(r) for r in st.refs]) if st.refs else ((), ())
            leaf_exprs[st.index] = ex
            leaf_batched[st.index] = bt
            lines = step_lines[st.index] = []
            batched = list(bt)
            var = f"v{st.index}"
            if not any(batched):
                expr = em.call(st.func if not hasattr(st.func, "record_in") else st.func.fn,
                               *self._rebuilt(st, ex))
                any_b = False
                if draws(st):  # a random factory (torch.rand(8)): one draw per node, not one per group
                    expr = f"{em.name(per_node_draws, 'N')}(n, lambda: {expr})"
                    any_b = True
            else:
                expr, rname = self._lower_step(em, st, ex, batched)
                rules[rname] += 1
                step_rule[st.index] = rname
                any_b = True
            n_out = len(st.out_dids)
            if st.out_struct is LEAF:
                lines.append(f"    {var}_0 = {expr}")
            else:
                fl = em.name(_flat_outputs, "flat")
                lines.append(f"    {var} = {fl}({expr})")
                for s in range(n_out):
                    lines.append(f"    {var}_{s} = {var}[{s}]")
            rplan = self.ragged_plan.get(st.index) if self.ragged_plan is not None else None
            chk = checks[st.index] = []
            for s in range(n_out):
                kind = "'ragged'" if rplan is not None and rplan[2][s] is not None else any_b
                chk.append(f"    r = _chk({st.out_dids[s]}, n, {var}_{s}, {kind})")
                chk.append(f"    if r is not None: raise _StepFailed({st.index}, r)")
            for s in range(n_out):
                vals[(st.index, s)] = (f"{var}_{s}", any_b)
        outs = []
        for ref, did in zip(prog.out_refs, prog.out_dids):
            e, b = leaf_expr(ref)
            if not b:
                shape = DESCS[did][0]
                e = f"{e}.unsqueeze(0).expand((n,) + {tuple(shape)!r})"
            outs.append(e)
        ret = f"    return [{', '.join(outs)}]"

        def guarded(i):
            """Step ``i``'s lines inside a try that names the step, then its checks (none for a
            product folded into an accumulated sum: its value is never made)."""
            lines = step_lines[i]
            if not lines:
                return lines
            return (["    try:"] + ["    " + ln for ln in lines]
                    + ["    except Exception as e:",
                       f"        raise _StepFailed({i}, f'{{type(e).__name__}}: {{e}}') from e"]
                    + checks[i])

        def source(clusters, deferred, lines_of):
            body = _assemble(em, prog, lines_of, clusters, deferred) + [ret]
            return f"def run({', '.join(params)}):\n" + "\n".join(body) + "\n"

        def compiled(src):
            ns = dict(em.ns)  # (each function its own globals: the two share the objects)
            exec(compile_program(src, f"<batchcraft program {prog.name}>"), ns)
            return ns["run"]

        accumulated = frozenset()
        try:
            accumulated = _accumulate_products(em, prog, step_lines, step_rule, leaf_exprs, leaf_batched)
        except Exception as exc:  # a rewriting bug must cost the rewrite, never the batching
            self.rewrite_error = f"{type(exc).__name__}: {exc}"
        rows_ins = frozenset()
        try:
            rows_ins = _products_from_rows(em, prog, step_lines, step_rule)
        except Exception as exc:  # (as above: the program keeps its gathers)
            self.rewrite_error = f"{type(exc).__name__}: {exc}"
        cut = -1
        if rows_ins:
            try:
                cut = _cut_output(em, prog, step_lines, leaf_batched)
            except Exception as exc:  # (as above: every row is computed)
                self.rewrite_error = f"{type(exc).__name__}: {exc}"
        if rows_ins:
            try:
                _join_sums(em, prog, step_lines)
            except Exception as exc:  # (as above: the products run as lowered)
                self.rewrite_error = f"{type(exc).__name__}: {exc}"
        clusters, deferred, checked = [], {}, None
        if self.fuse:
            try:
                kept_out = {**self.fallbacks, **{i: "accumulated product" for i in accumulated}}
                clusters = _fuse.plan(prog, leaf_exprs, leaf_batched, self.ragged_plan, kept_out)
                deferred = _deferrable(prog, clusters, self.ragged_plan)
                checked = compiled(source(clusters, deferred, guarded))
            except Exception as exc:  # a planning bug must cost the fusion, never the batching
                self.fuse_error = f"{type(exc).__name__}: {exc}"
                clusters, deferred = [], {}
        if checked is None:
            checked = compiled(source([], {}, guarded))
        self.clusters = clusters
        outs_at = _output_index(prog)
        self.writes_outputs = any(cl.space == "node" and any((k[1], k[2]) in outs_at for k in cl.outputs)
                                  for cl in clusters)

        def fast():
            src = source(clusters, deferred, step_lines.__getitem__)
            return compiled(src), src

        taken = Taken(frozenset(j for k, j in deferred.values() if k == "in"),
                      frozenset(r for k, r in deferred.values() if k == "ragged"), rows_ins, cut)
        return checked, fast, rules, taken

    @staticmethod
    def _rebuilt(st, exprs):
        it = iter([_X(e) for e in exprs])
        args = list(rebuild(st.struct[0], it))
        kwargs = rebuild(st.struct[1], it) if st.struct[1] is not None else {}
        return args, kwargs

    def _lower_step(self, em, st, exprs, batched):
        """(expression, rule name) of one batched step."""
        if self.ragged_plan is not None and st.index in self.ragged_plan:
            from batchcraft.autobatching import ragged

            return ragged.lower_step(self, em, st, exprs, batched, self.ragged_plan[st.index]), "ragged"
        if st.index in self.fallbacks:
            fn = _per_instance(st.func.fn if hasattr(st.func, "record_in") else st.func, st.struct, batched)
            return f"{em.name(fn, 'P')}({', '.join(exprs)})", "fallback"
        if st.info is not None and st.info.program is not None:  # a nested static block
            nested = Runner(st.info.program, self.kernels, fuse=self.fuse)
            ins = []
            for e, b, d in zip(exprs, batched, st.dids):
                if d is None:
                    continue  # consts are inside the nested trace
                ins.append(e if b else f"{e}.unsqueeze(0).expand((n,) + {tuple(DESCS[d][0])!r})")
            tail = "[0]" if st.out_struct is LEAF else ""
            return f"{em.name(nested, 'B')}.dense(n, {', '.join(ins)}){tail}", "block"
        rule = rule_for(st.func)
        if rule is None:
            self.fallbacks[st.index] = "no batching rule (custom operator without a vmap rule)"
            return self._lower_step(em, st, exprs, batched)
        if rule.lower is not None:
            lw = StepView(em, st, exprs, batched, self.kernels, self.fuse)
            args, kwargs = self._rebuilt_wrapped(st, lw)
            try:
                e = rule.lower(st.func, args, kwargs, lw)
            except Exception:  # the rule function below is always available
                e = None
            if e is not None:
                return e, rule.name
        shapes = leaf_shapes(st)
        fn = _rule_call(rule.fn, st.func, st.struct, batched, shapes)
        return f"{em.name(fn, 'R')}({', '.join(exprs)})", rule.name

    @staticmethod
    def _rebuilt_wrapped(st, lw):
        it = iter([_LeafX(j, lw) for j in range(len(lw.exprs))])
        args = list(rebuild(st.struct[0], it))
        kwargs = rebuild(st.struct[1], it) if st.struct[1] is not None else {}
        return args, kwargs

    # -- running -----------------------------------------------------------------------------------
    def dense(self, n, *ins):
        return self(n, ins, (), (), ())

    def prepare(self) -> Taken:
        """Lower the program if it is not yet, and return the inputs it takes as rows
        (:class:`Taken`): the executor calls it before it gathers a group's inputs, so that a
        program's first run already reads its inputs in place."""
        if self._fast is None and self._checked is None:
            self._lower()
        return self.taken

    def _lower(self) -> None:
        self._checked, self._make_fast, self.rules, taken = self._build()
        self.taken = taken  # (published after the programs that take them)

    def __call__(self, n, ins, rags=(), segs=(), cnts=(), dest=None, taken=None, live=None):
        """The program's outputs for ``n`` nodes. ``dest``: a list of ``(n, ...)`` tensors, one per
        output, that no input reads (rows of the executor's output arena): the fused kernels that
        compute an output write it there (``writes_outputs``); any other output is a new tensor.
        ``taken``: the :class:`Taken` the caller gathered ``ins`` and ``rags`` by (from
        :meth:`prepare`; None: plain tensors). Inputs passed as rows that the program now running
        does not take as rows (another thread lowered it again in between) are copied first.
        ``live``: only the first ``live`` nodes read output ``taken.cut_out`` (the program may
        leave its other rows NaN); None: every node's outputs are computed."""
        fast = self._fast
        if fast is not None:
            if taken is not None and taken is not self.taken:
                ins, rags = _conform(ins, rags, self.taken)
                live = None  # (the program now running may cut another output)
            if dest is None and live is None:
                return fast(n, *ins, *rags, *segs, *cnts)
            return fast(n, *ins, *rags, *segs, *cnts, D=dest, L=live)
        while True:
            if self._checked is None:
                self._lower()
            if taken is not self.taken:
                ins, rags = _conform(ins, rags, self.taken)
                taken = self.taken
                live = None
            c = _fuse.COUNTS
            counted = (c.calls, c.steps, c.declined)
            try:
                out = self._checked(n, *ins, *rags, *segs, *cnts, D=dest, L=live)
            except StepFailed as exc:
                c.calls, c.steps, c.declined = counted  # (the run is made again: its kernels count once)
                st = self.program.steps[exc.index]
                if exc.index in self.fallbacks or (self.ragged_plan is not None and exc.index in self.ragged_plan):
                    raise AutobatchError(f"step {st.name} of {self.program.name} failed one instance at a time too: "
                                         f"{exc.reason}") from exc.__cause__
                self.fallbacks[exc.index] = f"{st.name}: {_explained(exc.reason)}"
                self._checked = None
                continue
            try:
                fast, self.source = self._make_fast()
            except Exception as exc:  # a lowering bug: the checked program (same steps) serves
                fast, self.source = self._checked, ""
                self.lower_error = f"{type(exc).__name__}: {exc}"
            self._make_fast = None
            self._fast = fast
            return out

    @property
    def deferred_ins(self) -> frozenset:
        return self.taken.deferred_ins

    @property
    def deferred_rags(self) -> frozenset:
        return self.taken.deferred_rags

    @property
    def rows_ins(self) -> frozenset:
        return self.taken.rows_ins

    @property
    def fallback_steps(self) -> int:
        return len(self.fallbacks)


def _explained(reason: str) -> str:
    """A step's failure as its fallback reason, with what the user can do where that is known."""
    if "setup_context staticmethod" in reason:  # torch's vmap of a custom autograd.Function
        return ("a custom autograd.Function without setup_context runs one instance at a time (torch's vmap "
                "needs forward(*args) plus setup_context(ctx, inputs, output), and a vmap staticmethod or "
                "generate_vmap_rule = True, to batch it)")
    return reason


def _unread_inputs(prog) -> frozenset:
    """The single inputs ``("in", j)`` of ``prog`` that no step and no output refers to (steps of
    nested blocks are reached through their step's refs)."""
    read = {r[1] for st in prog.steps for r in st.refs if r[0] == "in"}
    read |= {r[1] for r in prog.out_refs if r[0] == "in"}
    return frozenset(j for j in range(prog.n_in) if j not in read)


def _deferrable(prog, clusters, ragged_plan=None) -> dict:
    """``{operand key: input}`` for the inputs ``("in", j)`` / ``("ragged", r)`` that only fused
    kernels read, each as a row operand of the kernel's rows (kind "b"): not read by an unfused
    step, a chunk run again outside its cluster, a gathered-by-segment operand, or the program's
    outputs. A ragged ``stack`` step is the member rows themselves: its value stands for them."""
    alias = {}
    if ragged_plan is not None:
        for st in prog.steps:
            e = ragged_plan.get(st.index)
            if e is not None and e[0][0] == "stack":
                alias[("val", st.index, 0)] = ("ragged", e[0][2])

    def source(key):
        return alias.get(key, key if key[0] in ("in", "ragged") else None)

    fused = {i for cl in clusters for i in cl.members}
    ok: dict = {}
    keys: dict = {}
    for cl in clusters:
        for k in cl.operand_keys:
            src = source(k)
            if src is not None:
                ok[src] = ok.get(src, True) and cl.operand_info[k][1] == "b"
                keys[k] = src
            elif k[0] == "gathered":
                src = source(k[2:])
                if src is not None:
                    ok[src] = False
        for i in cl.remat:
            for r in prog.steps[i].refs:
                src = source(_fuse._key(r))
                if src is not None:
                    ok[src] = False
    for st in prog.steps:
        if st.index not in fused and ("val", st.index, 0) not in alias:
            for r in st.refs:
                src = source(_fuse._key(r))
                if src is not None:
                    ok[src] = False
    for r in prog.out_refs:
        src = source(_fuse._key(r))
        if src is not None:
            ok[src] = False
    return {k: src for k, src in keys.items() if ok[src]}


def _assemble(em, prog, lines_of, clusters, deferred=None) -> list:
    """The function body: each step's lines (``lines_of(step index)``), with each fused cluster's
    kernel call (and its steps, as lowered, for when the call declines) where the cluster runs
    (:mod:`fuse`). A ``deferred`` input (:func:`_deferrable`) may arrive as ``gather.Rows``: the
    unfused branch copies it into a tensor first."""
    at: dict = {}
    fused = set()
    for cl in clusters:
        at.setdefault(cl.before, []).append(cl)
        fused.update(cl.members)
    lines: list = []

    # program outputs a node-space kernel computes: written straight into the rows the executor
    # passes as ``D`` (its output arena), instead of new tensors copied there afterwards
    out_index = _output_index(prog)

    def emit(cl):
        fz = em.name(cl.call, "fz")
        rows = "n" if cl.space == "node" else f"len(S{cl.space})"
        seg = "None" if cl.space == "node" else f"S{cl.space}"
        dmap = tuple(out_index.get((k[1], k[2]), -1) for k in cl.outputs) if cl.space == "node" else ()
        tail = f", dest=D, dmap={dmap!r}" if any(j >= 0 for j in dmap) else ""
        lines.append(f"    _r = {fz}({rows}, {seg}, {', '.join(cl.operands)}{tail})")
        lines.append("    if _r is None:")
        for k, e in zip(cl.operand_keys, cl.operands):
            if deferred and k in deferred:
                lines.append(f"        {e} = {em.name(_materialize, 'M')}({e})")
        for i in cl.members:
            lines.extend("    " + ln for ln in lines_of(i))
        lines.append("    else:")
        lines.append(f"        {', '.join(f'v{k[1]}_{k[2]}' for k in cl.outputs)}, = _r")
        for i in cl.remat:
            lines.extend("    " + ln for ln in lines_of(i))

    for st in prog.steps:
        for cl in at.get(st.index, ()):
            emit(cl)
        if st.index not in fused:
            lines.extend(lines_of(st.index))
    for cl in at.get(None, ()):
        emit(cl)
    return lines


def _output_index(prog) -> dict:
    """``{(step, slot): first output index}`` of the program's outputs that are step values."""
    index: dict = {}
    for j, ref in enumerate(prog.out_refs):
        if ref[0] == "val":
            index.setdefault((ref[1], ref[2]), j)
    return index


_ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__})


def _accumulate_products(em, prog, step_lines, step_rule, leaf_exprs, leaf_batched) -> int:
    """``x @ W1 + y @ W2`` (both products with a shared 2-D right operand, read only by the sum):
    the second product is added into the first one's fresh result by one GEMM with beta 1
    (:func:`matmul_accumulate`) instead of a product, then a sum over both (MV-RNN's ``P^T``:
    a pass over the rows and a temporary of their size saved). Returns the steps rewritten (each
    sum and its folded product): no fused elementwise kernel may take them, as it would read the
    folded product, whose value is never made (a new user's trial, stop 54: ``NameError``)."""
    reads: dict = {}
    for st in prog.steps:
        for r in st.refs:
            if r[0] == "val":
                reads[(r[1], r[2])] = reads.get((r[1], r[2]), 0) + 1
    for r in prog.out_refs:
        if r[0] == "val":
            reads[(r[1], r[2])] = reads.get((r[1], r[2]), 0) + 2  # an output: never rewritten
    mm = em.name(torch.matmul, "F")
    steps = prog.steps
    done = set()
    for st in steps:
        if (st.func not in _ADDS or st.struct[1] is not None or len(st.refs) != 2 or step_rule.get(st.index) != "elementwise"
                or len(st.out_dids) != 1):
            continue
        a, b = st.refs
        if a[0] != "val" or b[0] != "val" or a[2] != 0 or b[2] != 0 or a[1] == b[1]:
            continue
        ok = True
        for r in (a, b):
            src = steps[r[1]]
            ok = ok and (reads.get((r[1], 0)) == 1 and step_rule.get(src.index) == "matmul" and len(src.out_dids) == 1
                         and src.out_dids[0] == st.out_dids[0] and tuple(leaf_batched[src.index]) == (True, False)
                         and _rank(src, 1) == 2 and src.struct[1] is None
                         and step_lines[src.index] == [f"    v{src.index}_0 = {mm}({', '.join(leaf_exprs[src.index])})"])
        if not ok or step_lines[st.index] != [step_lines[st.index][0]]:
            continue
        x, w = leaf_exprs[b[1]]
        step_lines[b[1]] = []
        step_lines[st.index] = [f"    v{st.index}_0 = {em.name(matmul_accumulate, 'K')}(v{a[1]}_0, {x}, {w})"]
        done.update((st.index, b[1]))
    return frozenset(done)


def _products_from_rows(em, prog, step_lines, step_rule) -> frozenset:
    """The inputs that only batched products read, each as a bare argument (a ``matmul`` step,
    or the second product of an accumulated sum): those products call :mod:`rowmm`, which reads
    the input's rows in place when the executor passes them as
    :class:`~batchcraft.autobatching.gather.RowRefs` (``Runner.rows_ins``) and is
    ``torch.matmul`` / :func:`matmul_accumulate` otherwise. Returns those inputs' indices
    (none where this build has no pointer-array GEMM: the gathers stay; the GEMM is looked up and
    checked, once per process, only when some input qualifies)."""
    mm = em.name(torch.matmul, "F")
    acc = em.name(matmul_accumulate, "K")
    rmm = em.ns_name(_rowmm.matmul)  # (rules._lower_matmul's shared-left products call it already)
    calls = {}  # step -> (kind, bare arguments) of its one line, a call of mm or acc
    folded = set()  # products added in by an accumulated sum's line (their own lines are gone)
    for st in prog.steps:
        lines = step_lines[st.index]
        if not lines:
            if step_rule.get(st.index) == "matmul":
                folded.add(st.index)
            continue
        for kind, callee in (("mm", mm), ("acc", acc), ("rm", rmm)):
            if callee is None:
                continue
            head = f"    v{st.index}_0 = {callee}("
            if len(lines) == 1 and lines[0].startswith(head) and lines[0].endswith(")") \
                    and (kind == "acc" or step_rule.get(st.index) == "matmul"):
                args = lines[0][len(head):-1].split(", ")
                calls[st.index] = (kind, args)
    readers: dict = {}
    for st in prog.steps:
        for r in st.refs:
            if r[0] == "in":
                readers.setdefault(r[1], set()).add(st.index)
    outs = {r[1] for r in prog.out_refs if r[0] == "in"}
    text = [ln for st in prog.steps for ln in step_lines[st.index]]
    eligible = []
    for j, steps in readers.items():
        name = f"I{j}"
        if j in outs or not all(i in calls or i in folded for i in steps):
            continue
        # every use of the input in the program is a bare argument of one of those calls
        uses = sum(len(re.findall(rf"\b{name}\b", ln)) for ln in text)
        bare = sum(args.count(name) for _, args in calls.values())
        if uses and uses == bare:
            eligible.append(j)
    if not eligible or not (_rowmm.sgemm_batch() or _rowmm.shared_kernel()):
        return frozenset()
    rmm = em.name(_rowmm.matmul, "RM")
    racc = em.name(_rowmm.matmul_accumulate, "RA")
    for i, (kind, args) in calls.items():
        if kind != "rm" and any(f"I{j}" in args for j in eligible):  # (rm: rowmm's already)
            old = f" = {mm}(" if kind == "mm" else f" = {acc}("
            step_lines[i] = [step_lines[i][0].replace(old, f" = {rmm}(" if kind == "mm" else f" = {racc}(", 1)]
    return frozenset(eligible)


def _cut_output(em, prog, step_lines, leaf_batched) -> int:
    """The output whose rows the program can leave uncomputed past a prefix (``L``), or -1.

    When a group's nodes include some whose output ``j`` nothing reads (MV-RNN's ``P^T`` of each
    sentence's last composition: 5.7% of its 128 x 128 x 128 products), the executor puts them
    last (``Recorder.dead_last``) and passes ``L``, the count of the others. This finds an output
    that only row products compute: every step only it needs (none another output needs) is a
    product of per-node rows and a shared matrix (:func:`rowmm.matmul`,
    :func:`rowmm.matmul_accumulate`) or reads no per-node value; the output is one of those
    products. Their lines get ``L`` (``rowmm`` computes rows ``< L`` and leaves the rest NaN)."""
    rmm = em.ns_name(_rowmm.matmul)
    racc = em.ns_name(_rowmm.matmul_accumulate)
    if rmm is None and racc is None:
        return -1
    steps = prog.steps

    def needs(index):
        seen, todo = set(), [index]
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            todo += [r[1] for r in steps[i].refs if r[0] == "val"]
        return seen

    heads = [(j, r[1]) for j, r in enumerate(prog.out_refs) if r[0] == "val" and r[2] == 0]
    for j, head in heads:
        if any(r[0] == "val" and r[1] == head for k, r in enumerate(prog.out_refs) if k != j):
            continue  # (the same value is another output too)
        others = set()
        for k, r in enumerate(prog.out_refs):
            if k != j and r[0] == "val":
                others |= needs(r[1])
        own = needs(head) - others
        if head not in own:
            continue
        products, ok = [], True
        for i in own:
            lines = step_lines[i]
            if not lines:
                continue  # (a product folded into an accumulated sum)
            line = lines[0] if len(lines) == 1 else ""
            if rmm is not None and line.startswith(f"    v{i}_0 = {rmm}(I") and tuple(leaf_batched[i]) == (True, False):
                products.append(i)
            elif racc is not None and line.startswith(f"    v{i}_0 = {racc}(v") and ", I" in line:
                products.append(i)
            elif any(leaf_batched[i]) or any(r[0] in ("in", "ragged") for r in steps[i].refs):
                ok = False  # a per-node step that is not such a product
                break
        if ok and head in products:
            for i in products:
                step_lines[i] = [step_lines[i][0][:-1] + ", L)"]
            return j
    return -1


def _join_sums(em, prog, step_lines) -> int:
    """``rowmm.matmul_accumulate(rowmm.matmul(I_a, W1), I_b, W2)`` (MV-RNN's
    ``A^T W1^T + B^T W2^T`` after :func:`_accumulate_products` and :func:`_products_from_rows`)
    becomes one :func:`rowmm.sum_of_products` call at the sum's line, which writes each output
    tile once. The first product's line goes (only the sum reads it). Returns how many."""
    rmm = em.ns_name(_rowmm.matmul)
    racc = em.ns_name(_rowmm.matmul_accumulate)
    if rmm is None or racc is None:
        return 0
    acc_re = re.compile(rf"^    v(\d+)_0 = {re.escape(racc)}\(v(\d+)_0, (I\d+), ([\w.]+)(, L)?\)$")
    mm_re = re.compile(rf"^    v(\d+)_0 = {re.escape(rmm)}\((I\d+), ([\w.]+)(, L)?\)$")
    done = 0
    for st in prog.steps:
        lines = step_lines[st.index]
        ma = acc_re.match(lines[0]) if len(lines) == 1 else None
        if not ma:
            continue
        b = int(ma.group(2))
        first = step_lines.get(b, [])
        mb = mm_re.match(first[0]) if len(first) == 1 else None
        if not mb or (mb.group(4) or "") != (ma.group(5) or ""):
            continue
        name = em.name(_rowmm.sum_of_products, "RS")
        step_lines[b] = []
        step_lines[st.index] = [f"    v{st.index}_0 = {name}({mb.group(2)}, {mb.group(3)}, {ma.group(3)}, {ma.group(4)}"
                                f"{ma.group(5) or ''})"]
        done += 1
    return done


def _rank(st, j: int):
    """Rank of leaf ``j`` of step ``st`` (a constant tensor's or a value's descriptor), or None."""
    ref = st.refs[j]
    if ref[0] == "const":
        return ref[1].dim() if isinstance(ref[1], torch.Tensor) else None
    did = st.dids[j]
    return len(DESCS[did][0]) if did is not None else None


def matmul_accumulate(acc, y, w):
    """``acc + y @ w`` where ``acc`` is a fresh product nothing else reads: ``y @ w`` added into
    ``acc`` in place by ``addmm_`` (``(..., K) @ (K, N)`` folded to 2-D as ``matmul`` folds it)
    where no autograd, autocast or torch.func wrapper is involved and the shapes line up; else
    the sum as written. Float32 rounding: the GEMM adds its product to ``acc`` once, as the sum does."""
    if (type(acc) is torch.Tensor and type(y) is torch.Tensor and isinstance(w, torch.Tensor) and w.dim() == 2
            and not (torch.is_grad_enabled() and (acc.requires_grad or y.requires_grad or w.requires_grad))
            and not torch._C._is_any_autocast_enabled() and acc.is_contiguous() and acc.dim() >= 2
            and y.shape[:-1] == acc.shape[:-1] and y.shape[-1] == w.shape[0] and acc.shape[-1] == w.shape[1]
            and acc.dtype == y.dtype == w.dtype and acc.device == y.device == w.device):
        acc.view(-1, acc.shape[-1]).addmm_(y.reshape(-1, y.shape[-1]), w)
        return acc
    return acc + torch.matmul(y, w)


def per_node_draws(n, draw):
    """``n`` calls of ``draw`` stacked: each node of a group its own sample (a random factory with
    no per-instance argument inside a static block; once per group it gave all nodes one draw)."""
    outs = [draw() for _ in range(n)]
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs)
    return type(outs[0])(torch.stack(x) for x in zip(*outs))


def _flat_outputs(out) -> list:
    flat: list = []
    flatten(out, flat, _NoLazy)
    return flat


def _rule_call(rule_fn, func, struct, batched, shapes):
    bidx = batched.index(True)
    mask = list(batched)

    def f(*leaves):
        return rule_fn(func, struct, list(leaves), mask, shapes, leaves[bidx].shape[0])

    return f


__all__ = ["Runner", "Emitter", "StepView", "StepFailed", "Taken"]
