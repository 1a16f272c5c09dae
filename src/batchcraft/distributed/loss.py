"""A per-instance loss run over a rank's whole shard in one forward: the module DDP wraps.

DistributedDataParallel expects one forward and one backward per step: its reducer prepares the
gradient buckets in forward and all-reduces each bucket as soon as backward has filled it, so the
communication overlaps the rest of backward (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, §3.2). Auto-batching wants the same shape: all
of the rank's instances in one call. :class:`AutobatchLoss` is that module.

DDP *averages* gradients over ranks. To make a data-parallel step equal one process's step over
the union of the shards, the gradient of each rank's summed loss is multiplied by the world size
in backward (the value stays the summed loss): the average of ``world_size * grad(sum_r)`` over
ranks is ``grad(sum over the union)``. Divide the returned loss by the *global* normaliser (total
work of the step over all ranks, :meth:`EpochPlan.global_work`), never by the rank's own: the
mean of per-rank means is not the mean when shards differ in size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from batchcraft.autobatching import autobatch


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def world_size() -> int:
    """Ranks in the default process group, 1 when ``torch.distributed`` is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class AutobatchLoss(nn.Module):
    """Sum of a per-instance loss over a list of instances, computed by one ``autobatch`` call.

    Wrap it in ``DistributedDataParallel`` (see :func:`batchcraft.distributed.wrap`) and call the
    wrapped module once per step with all of the rank's instances.

    Args:
        model (nn.Module): per-instance loss, ``model(instance) -> scalar tensor``. Its parameters
            are this module's parameters (``self.model``), so DDP sees and all-reduces them.
        grad_scale (float | None): factor on the gradient of the returned loss. Default: the
            world size of the default process group (1 outside ``torch.distributed``), which
            turns DDP's gradient average into the sum over ranks.
        zero_term (bool): add ``0 * sum(p.sum())`` over all parameters, so every parameter is
            used on every step and DDP needs no ``find_unused_parameters``. Gradients of unused
            parameters are then zeros instead of None: an optimizer with momentum or weight decay
            moves them, unlike one process. Default: False (see docs/scale-out.md).
        **autobatch_options: passed to :func:`batchcraft.autobatch` (``scheduler=``, ...).
    Call:
        ``forward(instances)`` with a list of instances -> 0-dim tensor: the sum of
        ``model(x)`` over ``instances`` (value unchanged by ``grad_scale``). An empty list gives
        a zero that still reaches every parameter, so a rank without instances can take part in
        the step.
    Raises:
        TypeError: ``instances`` is a single instance rather than a list of them: calling the
            DDP module once per instance forfeits batching, and with
            ``find_unused_parameters=True`` DDP fails in backward ("Expected to mark a variable
            ready only once").
        ValueError: ``model`` returned something that is not a scalar tensor.
    """

    def __init__(self, model: nn.Module, grad_scale: float | None = None, zero_term: bool = False,
                 **autobatch_options):
        super().__init__()
        self.model = model
        self.grad_scale = grad_scale
        self.zero_term = zero_term
        self.loss_fn = autobatch(model, **autobatch_options)

    def forward(self, instances):
        if not isinstance(instances, Sequence) or isinstance(instances, (str, bytes)):
            raise TypeError(
                f"AutobatchLoss: forward takes the list of this rank's instances, got one "
                f"{type(instances).__name__}; call the DDP module once per step with all of them "
                f"(once per instance forfeits batching and breaks DDP's bucketed all-reduce)")
        if len(instances) == 0 or self.zero_term:
            zero = sum((p.sum() * 0.0 for p in self.model.parameters() if p.requires_grad), torch.zeros(()))
        if len(instances) == 0:
            total = zero  # a rank with no instance this step: zero gradient to every parameter
        else:
            losses = self.loss_fn(list(instances))
            for i, loss in enumerate(losses):
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"AutobatchLoss: model must return a 0-dim loss tensor per "
                                     f"instance; instance {i} gave "
                                     f"{getattr(loss, 'shape', type(loss).__name__)}")
            total = torch.stack(losses).sum()
            if self.zero_term:
                total = total + zero
        scale = world_size() if self.grad_scale is None else float(self.grad_scale)
        if scale != 1.0 and total.requires_grad:
            total = _ScaleGrad.apply(total, scale)
        return total

    @property
    def stats(self):
        """:class:`batchcraft.RunStats` of the last forward's ``autobatch`` call."""
        return self.loss_fn.stats
