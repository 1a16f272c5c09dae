"""Graph analysis for parallelism tuning: heavy operators, FLOPs, depth and width.

Wang et al. (arXiv 1908.04705, their analysis of inter-operator parallelism) reduce a model's graph to its
*heavy* operators (matrix multiplication / fully connected, convolution, embedding lookup), since
only those take long enough for inter-operator parallelism to pay. The *depth* is the longest chain
of heavy operators through the data-flow graph, and the *average width* is heavy operators / depth:
how many heavy operators can run at once on average. Their guideline sets the number of inter-op
pools to about the average width.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from batchcraft.errors import ConfigurationError

__all__ = ["HeavyOp", "GraphAnalysis", "analyze", "trace", "heavy_kind"]

_HEAVY_MODULES: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "linear"),
    (nn.Conv1d, "conv"),
    (nn.Conv2d, "conv"),
    (nn.Conv3d, "conv"),
    (nn.ConvTranspose1d, "conv"),
    (nn.ConvTranspose2d, "conv"),
    (nn.ConvTranspose3d, "conv"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding"),
)
_HEAVY_FUNCTIONS = {
    F.linear: "linear", torch.addmm: "matmul", torch.matmul: "matmul", operator.matmul: "matmul",
    torch.mm: "matmul", torch.bmm: "matmul", torch.baddbmm: "matmul", torch.einsum: "matmul",
    F.conv1d: "conv", F.conv2d: "conv", F.conv3d: "conv",
    F.embedding: "embedding", F.embedding_bag: "embedding",
}
_HEAVY_METHODS = {"matmul": "matmul", "mm": "matmul", "bmm": "matmul", "__matmul__": "matmul"}


@dataclass(frozen=True)
class HeavyOp:
    """One heavy operator of the traced graph.

    Attributes:
        node (str): fx node name.
        kind (str): "linear", "matmul", "conv" or "embedding".
        target (str): module path or function name.
        flops (int): multiply-adds x 2 for one call at the example input; for embeddings the
            number of values read (a lookup does no arithmetic but moves memory).
        level (int): 1-based heavy-op depth: 1 + the most heavy ops on any path into it.
    """

    node: str
    kind: str
    target: str
    flops: int
    level: int


@dataclass
class GraphAnalysis:
    """Heavy-operator summary of a model's graph (Wang et al., arXiv 1908.04705).

    Attributes:
        heavy_ops (list[HeavyOp]): in graph order.
        depth (int): longest chain of heavy operators (0 if there is none).
        average_width (float): len(heavy_ops) / depth (0.0 if there is no heavy op).
        max_width (int): most heavy operators on one level.
        width_per_level (list[int]): heavy operators per level, level 1 first.
        total_flops (int): sum of the heavy operators' flops.
        n_nodes (int): fx nodes in the traced graph, placeholders and output included.
    """

    heavy_ops: list[HeavyOp] = field(default_factory=list)
    depth: int = 0
    average_width: float = 0.0
    max_width: int = 0
    width_per_level: list[int] = field(default_factory=list)
    total_flops: int = 0
    n_nodes: int = 0

    @property
    def parallel_flops_fraction(self) -> float | None:
        """Share of the heavy FLOPs that could run beside another heavy op, or None without FLOPs.

        Per level, every heavy op but the largest can overlap the largest, so at most this share of
        the work gains from inter-op pools (Amdahl): (sum over levels of the level's FLOPs minus its
        largest op's) / total FLOPs. A graph can be wide and still gain nothing: 18 embedding
        lookups next to each other are a tiny share of a recommender's FLOPs.
        """
        if not self.total_flops:
            return None
        per_level: dict[int, list[int]] = {}
        for h in self.heavy_ops:
            per_level.setdefault(h.level, []).append(h.flops)
        return sum(sum(v) - max(v) for v in per_level.values()) / self.total_flops

    def to_dict(self) -> dict:
        return {
            "heavy_ops": len(self.heavy_ops),
            "depth": self.depth,
            "average_width": self.average_width,
            "max_width": self.max_width,
            "width_per_level": list(self.width_per_level),
            "total_flops": self.total_flops,
            "n_nodes": self.n_nodes,
            "parallel_flops_fraction": self.parallel_flops_fraction,
        }


def trace(model) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` with torch.fx (a GraphModule is returned as is).

    Raises:
        ConfigurationError: the model cannot be traced (data-dependent control flow); the message
            names the model and gives torch.fx's reason.
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, ... depending on the construct
        raise ConfigurationError(
            f"analyze: cannot trace {type(model).__name__} with torch.fx: {exc}",
            hint="graph analysis and the inter-op executor need a statically traceable model; "
            "tune it with inter_op_threads=1 (plain eager) instead",
        ) from exc


def heavy_kind(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """Kind of heavy operator ``node`` is ("linear", "matmul", "conv", "embedding") or None."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        for cls, kind in _HEAVY_MODULES:
            if isinstance(mod, cls):
                return kind
        return None
    if node.op == "call_function":
        return _HEAVY_FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _HEAVY_METHODS.get(node.target)
    return None


def _numel(meta) -> int:
    if isinstance(meta, torch.Tensor):
        return meta.numel()
    if isinstance(meta, (tuple, list)):
        return sum(_numel(m) for m in meta)
    return 0


def _flops(gm: torch.fx.GraphModule, node: torch.fx.Node, kind: str, out, args) -> int:
    # Multiply-adds counted as 2 FLOPs; shapes come from the example run (no symbolic shapes).
    out_n = _numel(out)
    if kind == "embedding":
        return out_n
    if kind == "conv":
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if isinstance(mod, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
                per_in = mod.out_channels // mod.groups * math.prod(mod.kernel_size)
                return 2 * _numel(args[0]) * per_in
            per_out = mod.in_channels // mod.groups * math.prod(mod.kernel_size)
        else:
            weight = args[1]
            per_out = math.prod(weight.shape[1:])
        return 2 * out_n * per_out
    if kind == "linear":
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            k = mod.in_features if isinstance(mod, nn.Linear) else mod.in1_features * mod.in2_features
        else:
            k = args[1].shape[-1]
        return 2 * out_n * k
    # matmul family: contracted dimension = last dim of the first matrix operand
    mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1]
    if node.target in (torch.addmm, torch.baddbmm) and len(mats) >= 3:
        mats = mats[1:]
    if node.target is torch.einsum or not mats:
        return 2 * out_n  # contraction size unknown from shapes alone; a lower bound
    return 2 * out_n * mats[0].shape[-1]


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs the graph once, keeping each heavy node's inputs' shapes and output."""

    def __init__(self, gm):
        super().__init__(gm)
        self.flops: dict[str, int] = {}

    def run_node(self, n):
        out = super().run_node(n)
        kind = heavy_kind(self.module, n)
        if kind is not None:
            args, _ = self.fetch_args_kwargs_from_env(n)  # for call_method, self is args[0]
            self.flops[n.name] = _flops(self.module, n, kind, out, args)
        return out


def analyze(model, example_input=None) -> GraphAnalysis:
    """Find the heavy operators of ``model`` and the heavy-op depth and average width of its graph.

    Args:
        model (nn.Module or torch.fx.GraphModule): traced with ``torch.fx.symbolic_trace``.
        example_input (Tensor or tuple of Tensors, optional): run once (no grad) to get shapes for
            FLOPs; without it every flops value is 0. Default: None.
    Returns:
        GraphAnalysis: heavy ops with their level, depth, average and maximum width, FLOPs.
    Raises:
        ConfigurationError: the model cannot be traced by torch.fx.
    Source:
        Wang et al., "Exploiting Parallelism Opportunities with Deep Learning Frameworks",
        arXiv 1908.04705 (average width = heavy operators / depth of heavy operators).
    Example:
        >>> a = analyze(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        >>> (len(a.heavy_ops), a.depth, a.average_width)
        (2, 2, 1.0)
    """
    gm = trace(model)
    flops: dict[str, int] = {}
    if example_input is not None:
        inputs = example_input if isinstance(example_input, tuple) else (example_input,)
        rec = _ShapeRecorder(gm)
        with torch.no_grad():
            rec.run(*inputs)
        flops = rec.flops
    # Heavy-op level of every node = heavy ops on the longest path ending at it (graph order is
    # topological in fx, so one forward pass suffices).
    level: dict[torch.fx.Node, int] = {}
    heavy: list[HeavyOp] = []
    for node in gm.graph.nodes:
        base = max((level[i] for i in node.all_input_nodes), default=0)
        kind = heavy_kind(gm, node)
        if kind is None:
            level[node] = base
            continue
        level[node] = base + 1
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        heavy.append(HeavyOp(node.name, kind, target, int(flops.get(node.name, 0)), base + 1))
    depth = max((h.level for h in heavy), default=0)
    per_level = [0] * depth
    for h in heavy:
        per_level[h.level - 1] += 1
    return GraphAnalysis(
        heavy_ops=heavy,
        depth=depth,
        average_width=(len(heavy) / depth) if depth else 0.0,
        max_width=max(per_level, default=0),
        width_per_level=per_level,
        total_flops=sum(h.flops for h in heavy),
        n_nodes=len(gm.graph.nodes),
    )
