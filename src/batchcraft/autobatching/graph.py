"""The recorded graph: nodes with signatures and inline depths.

Each recorded operation of one instance becomes a :class:`Node`. Its depth is
computed while the program runs (1 + max depth of its pending inputs;
ACRoBat §4.2 "inline depth computation") and it is appended at once to the
bucket of its (depth, signature), so scheduling needs no pass over the graph.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class Node:
    """One recorded operation of one instance.

    Attributes:
        info (SigInfo): its signature's interned id, output descriptors and, for blocks, program.
        func: the torch function, Tensor method or static block.
        struct: argument structure (args, kwargs) with tensors replaced by markers.
        leaves (list): the tensors, lazy (per-instance) or real (shared), in order.
        depth (int): 1 + max depth of pending inputs.
        instance (int): index of the instance that recorded it.
        outs (list[Tensor] | None): after execution, the batched outputs of its group.
        row (int): its row in those batched outputs.
    """

    __slots__ = ("info", "func", "struct", "leaves", "depth", "instance", "outs", "row",
                 "requires_grad", "phase")

    def __init__(self, info, func, struct, leaves, depth, instance, phase, requires_grad):
        self.info = info
        self.func = func
        self.struct = struct
        self.leaves = leaves
        self.depth = depth
        self.instance = instance
        self.outs = None
        self.row = -1
        self.requires_grad = requires_grad
        self.phase = phase

    @property
    def key(self):
        return self.info.key

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", type(self.func).__name__)


class LeafNode:
    """A per-instance concrete tensor (instance input or a tensor created by instance code).

    It is already computed (depth 0). ``pyvalue`` keeps the Python scalar of
    ``torch.tensor(scalar)`` so that a group of them becomes one ``torch.tensor(list)``.
    """

    __slots__ = ("_value", "pyvalue", "dtype", "device", "outs", "row", "depth", "requires_grad",
                 "instance", "phase")
    name = "leaf"

    def __init__(self, value, pyvalue=None, instance=-1, dtype=None, device=None):
        self._value = value
        self.pyvalue = pyvalue
        self.dtype = dtype if value is None else value.dtype
        self.device = device if value is None else value.device
        self.outs = None
        self.row = -1
        self.depth = 0
        self.requires_grad = False if value is None else value.requires_grad
        self.instance = instance
        self.phase = -1

    @property
    def value(self):
        """The tensor (created on first use for ``torch.tensor(python_scalar)`` leaves)."""
        if self._value is None:
            with torch._C.DisableTorchFunction():  # may be read while the recording mode is on
                self._value = torch.tensor(self.pyvalue, dtype=self.dtype, device=self.device)
        return self._value


class Graph:
    """Pending (not yet executed) nodes, bucketed by phase, depth and signature."""

    def __init__(self):
        self.buckets: dict = defaultdict(list)  # (phase, depth, signature id) -> [Node]
        self.n_pending = 0

    def add(self, node: Node) -> None:
        self.buckets[(node.phase, node.depth, node.info.sid)].append(node)
        self.n_pending += 1

    def take(self) -> dict:
        """Remove and return all pending buckets."""
        b, self.buckets = self.buckets, defaultdict(list)
        self.n_pending = 0
        return b
