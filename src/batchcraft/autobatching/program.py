"""Programs: what a group of one signature runs, as straight-line steps.

Every signature executes a :class:`Program`: one step for a plain operation, the traced body
for a static block (ACRoBat §4.1, grain-size coarsening). A step names its operation, its
argument structure and, for each tensor leaf of that structure, where the value comes from:

* ``("in", j)``: the group's j-th per-instance input (batched, ``(n, ...)``);
* ``("ragged", r)``: the members of the r-th ragged list argument (flat rows, see :mod:`ragged`);
* ``("val", k, s)``: output ``s`` of an earlier step ``k``;
* ``("const", t)``: a tensor shared by all instances (a parameter, a captured tensor).

:mod:`lower` turns a program into one Python function over batched values.
"""

from __future__ import annotations

from batchcraft.autobatching.descs import DESCS
from batchcraft.autobatching.signature import LEAF


class Step:
    """One operation of a program.

    Attributes:
        func: the operation (or a nested static block).
        struct: argument structure (``signature.flatten``).
        refs (list[tuple]): where each tensor leaf comes from (see the module docstring).
        dids (list[int | None]): per leaf: descriptor id of a per-instance value, None for a const.
        batched (list[bool]): per leaf: does it vary per instance.
        out_struct, out_dids, out_rg: outputs per instance.
        state: ``op_state`` when traced (grad, inference, autocast).
        info: the step's own SigInfo when it is a nested static block.
    """

    __slots__ = ("index", "func", "struct", "refs", "dids", "batched", "out_struct", "out_dids", "out_rg",
                 "state", "info", "name", "consts")

    def __init__(self, index, func, struct, refs, dids, batched, out_struct, out_dids, out_rg, state, info=None):
        self.index = index
        self.func = func
        self.struct = struct
        self.refs = refs
        self.dids = dids
        self.batched = batched
        self.out_struct = out_struct
        self.out_dids = tuple(out_dids)
        self.out_rg = tuple(out_rg)
        self.state = state
        self.info = info
        self.name = getattr(func, "__name__", type(func).__name__)

    @property
    def shapes(self) -> list:
        """Per leaf: the per-instance shape (batched leaves) or the tensor's shape (consts)."""
        out = []
        for ref, did in zip(self.refs, self.dids):
            out.append(DESCS[did][0] if did is not None else tuple(ref[1].shape) if ref[0] == "const" else None)
        return out

    def __repr__(self) -> str:
        return f"Step({self.index}: {self.name}, refs={[r[0] if r[0] != 'val' else r for r in self.refs]})"


#: substrings of the names of operations that sample (or may)
RANDOM_NAMES = ("dropout", "rand", "bernoulli", "multinomial", "normal", "poisson", "uniform", "exponential",
                "geometric", "cauchy", "random", "shuffle", "rrelu", "gumbel", "fractional")


def draws(step) -> bool:
    """Does ``step`` make a random draw? A dropout traced with ``training=False`` (a module in eval
    mode) does not; any other step whose name says random does, or may."""
    name = step.name.lower()
    if "dropout" in name:
        kw = step.struct[1] if type(step.struct) is tuple and len(step.struct) == 2 else None
        if type(kw) is tuple and len(kw) == 3 and kw[0] is dict and "training" in kw[1]:
            return kw[2][kw[1].index("training")] != (bool, False)
        return True
    return any(r in name for r in RANDOM_NAMES)


class Program:
    """Steps in order plus where the outputs come from.

    Attributes:
        steps (list[Step]); out_refs (list[tuple]); out_struct; out_dids; out_rg.
        n_in (int): per-instance single inputs; n_ragged (int): ragged list inputs.
        ragged_classes (tuple[int]): for each ragged input, its length class (lists of one class
            have equal lengths in every node, so they share segment ids).
        shape_dependent (bool): the body read a shape while traced.
        uses_grad_consts (bool): a const requires grad (the block's parameters).
        lowered: cache of lowered runners (see :mod:`lower`).
    """

    def __init__(self, steps, out_refs, out_struct, out_dids, out_rg, n_in, n_ragged=0, ragged_classes=(),
                 shape_dependent=False, name="program"):
        self.steps = steps
        self.out_refs = out_refs
        self.out_struct = out_struct
        self.out_dids = tuple(out_dids)
        self.out_rg = tuple(out_rg)
        self.n_in = n_in
        self.n_ragged = n_ragged
        self.ragged_classes = tuple(ragged_classes)
        self.shape_dependent = shape_dependent
        self.name = name
        self.uses_grad_consts = any(r[0] == "const" and getattr(r[1], "requires_grad", False)
                                    for st in steps for r in st.refs) or any(
            st.info is not None and st.info.program is not None and st.info.program.uses_grad_consts
            for st in steps)
        self.lowered: dict = {}
        self.hoist = None

    @classmethod
    def single(cls, info) -> "Program":
        """The one-step program of a plain operation's signature."""
        refs, dids, batched = [], [], []
        j = 0
        lazy_dids = iter(info.in_dids)
        for kind, shared in zip(info.leaf_kinds, info.shared):
            if kind:
                refs.append(("in", j))
                dids.append(next(lazy_dids))
                batched.append(True)
                j += 1
            else:
                refs.append(("const", shared))
                dids.append(None)
                batched.append(False)
        out_rg = getattr(info, "out_rg", (False,) * len(info.out_dids))
        step = Step(0, info.func, info.struct, refs, dids, batched, info.out_struct, info.out_dids, out_rg,
                    info.state)
        n = len(info.out_dids)
        return cls([step], [("val", 0, s) for s in range(n)], info.out_struct, info.out_dids, out_rg, j,
                   name=info.name)

    def __repr__(self) -> str:
        return f"Program({self.name}, {len(self.steps)} steps, in={self.n_in}, ragged={self.n_ragged})"


def out_leaf_count(struct) -> int:
    """Number of tensor leaves in an output structure."""
    if struct is LEAF:
        return 1
    if type(struct) is tuple and struct and isinstance(struct[0], type):
        tag = struct[0]
        if tag is dict:
            return sum(out_leaf_count(s) for s in struct[2])
        if tag is tuple or tag is list or issubclass(tag, tuple):
            return sum(out_leaf_count(s) for s in struct[1])
    return 0
