"""Process group and DistributedDataParallel set-up for auto-batched training.

Nothing here replaces ``torch.distributed``: :func:`init` is ``init_process_group`` with the
backend chosen by device (gloo on CPU, nccl on CUDA) and torchrun's environment read;
:func:`wrap` is ``DistributedDataParallel`` with the device placement and the unused-parameter
rule of auto-batched models spelled out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from batchcraft.errors import ConfigurationError


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class Rank:
    """Where this process sits: ``rank`` of ``world_size`` ranks, ``local_rank`` on its node."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init(device: str | None = None, **init_kwargs) -> Rank:
    """Join the default process group (once) and return this process's :class:`Rank`.

    Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``
    set) no argument is needed. A CUDA device is ``cuda:LOCAL_RANK``.

    Args:
        device (str | None): ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).
        **init_kwargs: passed to ``torch.distributed.init_process_group`` (``init_method=``,
            ``rank=``, ``world_size=``, ``timeout=``).
    Raises:
        ConfigurationError: no rendezvous given (neither torchrun's variables nor
            ``init_method``), or CUDA asked for without a GPU.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigurationError("distributed.init: device 'cuda' asked for, but no CUDA device is visible")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if "init_method" not in init_kwargs and "MASTER_ADDR" not in os.environ and "store" not in init_kwargs:
            raise ConfigurationError(
                "distributed.init: no rendezvous: MASTER_ADDR is not set and no init_method was given",
                hint="start the script with torchrun (torchrun --nproc-per-node 2 script.py) or pass "
                     "init_method='file:///tmp/store', rank=..., world_size=...")
        dist.init_process_group(backend_for(dev), **init_kwargs)
    return Rank(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def wrap(module: nn.Module, *, find_unused_parameters: bool = False, device: torch.device | str | None = None,
         **ddp_kwargs) -> DistributedDataParallel:
    """Wrap ``module`` (usually an :class:`AutobatchLoss`) in ``DistributedDataParallel``.

    Args:
        module (nn.Module): the module; moved to ``device`` first.
        find_unused_parameters (bool): pass True for models whose control flow leaves
            parameters out of the loss on some steps: early exit (Berxit's later layers and
            the exit heads no instance left by), branches, a tree decoder that did not grow.
            DDP then walks the autograd graph after each forward and marks the parameters it
            does not reach as ready (zero contribution to the all-reduce; a parameter no rank
            used keeps ``grad None``, as in one process). Without it such a model fails on
            the next step ("Expected to have finished reduction in the prior iteration").
            The walk costs time per step: measured in docs/scale-out.md. Default: False.
        device (device | str | None): where the replica lives. Default: the module's device.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb=``, ...).
    Returns:
        DistributedDataParallel
    Raises:
        ConfigurationError: the default process group is not initialised (call :func:`init`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError("distributed.wrap: torch.distributed is not initialised",
                                 hint="call batchcraft.distributed.init() (or init_process_group) first")
    if device is None:
        p = next(module.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    module.to(device)
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index if device.index is not None else torch.cuda.current_device()])
    return DistributedDataParallel(module, find_unused_parameters=find_unused_parameters, **ddp_kwargs)
