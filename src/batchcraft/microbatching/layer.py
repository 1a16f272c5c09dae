"""The module that replaces ``Conv2d``: looks up the division planned for its input and runs the custom op.

A :class:`PlannedConv2d` keeps, per :class:`~batchcraft.microbatching.types.InputKey` of its own
input (shape, dtype, device), the steps of every planned pass. An input it has no plan for is
planned on first sight by its :class:`~batchcraft.microbatching.session.PlanningSession` (same
budget and policy; μ-cuDNN plans each new layer geometry the first time it sees it), then run.
It shares the original's ``weight`` and ``bias`` Parameters and registers nothing else, so
``state_dict`` keys and optimisers see no change.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from batchcraft.errors import WorkspaceError
from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.op import encode_steps, planned_conv2d
from batchcraft.microbatching.probe import probing
from batchcraft.microbatching.types import InputKey, Step

__all__ = ["PlannedConv2d"]


class PlannedConv2d(nn.Module):
    """Drop-in replacement for one ``Conv2d`` that runs its planned micro-batches.

    Input (N, C, H, W) -> output (N, O, Ho, Wo), equal to the original ``Conv2d`` within the
    rounding of the chosen algorithms in the input's dtype.

    Args:
        conv (nn.Conv2d): the layer replaced; zero padding only.
        layer_name (str): qualified name in the model (for errors and the plan table).
        geometry (ConvGeometry | None): per-sample geometry of ``steps`` (with ``key``). Default: None.
        steps (dict[str, list[tuple[str, int]]] | None): per pass, [(algorithm, micro_batch), ...]
            for ``key``. Default: None (nothing planned yet).
        key (InputKey | None): the input ``steps`` are for; None: a float32 CPU batch of
            ``steps``' size and ``geometry``'s spatial size.
        session (PlanningSession | None): plans inputs not seen before; None: such inputs raise
            :class:`~batchcraft.errors.WorkspaceError`.
    """

    def __init__(self, conv: nn.Conv2d, layer_name: str, geometry: ConvGeometry | None = None,
                 steps: Mapping[str, Sequence[Step]] | None = None, key: InputKey | None = None, session=None):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.layer_name = layer_name
        self.stride, self.padding, self.dilation = list(conv.stride), list(conv.padding), list(conv.dilation)
        self.groups = conv.groups
        self.original = [conv]  # list: not registered as a submodule (no duplicate parameters)
        self.session = session
        self._plans: dict[tuple, str] = {}  # (shape, dtype, device) -> encoded steps
        self.steps_by_key: dict[InputKey, dict[str, list[Step]]] = {}
        self.last_key: InputKey | None = None
        if steps is not None:
            if key is None:
                n = max((sum(s for _, s in st) for st in steps.values()), default=1)
                key = InputKey((n, geometry.in_channels, geometry.height, geometry.width), "float32", "cpu")
            self.set_steps(key, steps)

    @staticmethod
    def _lookup_key(x: torch.Tensor) -> tuple:
        return (tuple(x.shape), x.dtype, x.device)

    def set_steps(self, key: InputKey, steps: Mapping[str, Sequence[Step]]) -> None:
        """Run ``steps`` ({pass: [(algorithm, micro_batch), ...]}) for inputs of ``key``."""
        self.steps_by_key[key] = {p: list(s) for p, s in steps.items()}
        lookup = (tuple(key.shape), key.torch_dtype, torch.device(key.device))
        self._plans[lookup] = encode_steps(steps)
        self.last_key = key

    @property
    def steps(self) -> dict[str, list[Step]]:
        """Steps for the most recently planned input (what a single-geometry plan runs)."""
        return {} if self.last_key is None else self.steps_by_key[self.last_key]

    @steps.setter
    def steps(self, steps: Mapping[str, Sequence[Step]]) -> None:
        if self.last_key is None:
            raise WorkspaceError(f"layer {self.layer_name}: no planned input to set steps for")
        self.set_steps(self.last_key, steps)

    @property
    def geometry(self) -> ConvGeometry | None:
        """Per-sample geometry of the most recently planned input."""
        if self.last_key is None:
            return None
        return ConvGeometry.from_conv(self.original[0], self.last_key.shape[2:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if probing():  # being planned: run the original convolution, plan nothing
            return self.original[0](x)
        plan = self._plans.get(self._lookup_key(x))
        if plan is None:
            plan = self._plan_on_first_sight(x)
        return planned_conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
                              self.layer_name, plan)

    @torch.compiler.disable
    def _plan_on_first_sight(self, x: torch.Tensor) -> str:
        # runs eagerly under torch.compile (a graph break); planning measures real kernels
        if x.dim() != 4 or x.shape[1] != self.weight.shape[1] * self.groups:
            raise WorkspaceError(f"layer {self.layer_name}: expected input (N, {self.weight.shape[1] * self.groups}, H, W), "
                                 f"got {tuple(x.shape)}")
        key = InputKey.of(x)
        if torch.compiler.is_exporting():
            raise WorkspaceError(
                f"layer {self.layer_name}: no plan for input {key.describe()} while exporting",
                hint="run the planned model once on an input of this shape and dtype (it is planned then), "
                     "or pass such an input to batchcraft.microbatch, before torch.export")
        if self.session is None:
            raise WorkspaceError(f"layer {self.layer_name}: no plan for input {key.describe()}",
                                 hint="plan it: batchcraft.microbatch(model, example_input_of_this_shape)")
        self.session.plan_layer(self, x)
        return self._plans[self._lookup_key(x)]

    def extra_repr(self) -> str:
        return f"{self.layer_name}: " + "; ".join(
            f"{k.describe()}: " + ", ".join(f"{p}={'+'.join(f'{a}:{n}' for a, n in s)}" for p, s in st.items())
            for k, st in self.steps_by_key.items())
