"""Data-parallel training of auto-batched models on ``torch.distributed`` (DDP).

Each rank runs its shard of the step's instances through one ``autobatch`` call inside one
DistributedDataParallel forward; DDP all-reduces gradient buckets during backward. Instances are
sharded by work (tree nodes, tokens) so ranks finish their steps together; ranks with fewer
batches finish through ``torch.distributed.algorithms.Join``.

* :func:`shard_by_work`, :func:`plan_epoch` (``shard.py``): work-balanced shards and per-rank
  batches under a work budget, the same on every rank.
* :class:`AutobatchLoss` (``loss.py``): ``forward(instances)`` -> summed loss, gradient scaled so
  that DDP's average is the gradient over the union of the shards.
* :func:`init`, :func:`wrap` (``ddp.py``): process group (gloo on CPU, nccl on CUDA, torchrun's
  environment) and the DDP wrapper.

Example (run with ``torchrun --nproc-per-node 2 script.py``)::

    rank = distributed.init()
    plan = distributed.plan_epoch(sentences, rank.world_size, max_batch_work=400)
    ddp = distributed.wrap(distributed.AutobatchLoss(per_instance_loss))
    with torch.distributed.algorithms.Join([ddp]):
        for step, batch in enumerate(plan.rank_batches(rank.rank)):
            loss = ddp([sentences[i] for i in batch]) / plan.global_work(step)
            opt.zero_grad(); loss.backward(); opt.step()
"""

from batchcraft.distributed.ddp import Rank, backend_for, init, wrap
from batchcraft.distributed.loss import AutobatchLoss, world_size
from batchcraft.distributed.shard import EpochPlan, batch_by_work, instance_work, plan_epoch, shard_by_work

__all__ = ["AutobatchLoss", "EpochPlan", "Rank", "backend_for", "batch_by_work", "init", "instance_work",
           "plan_epoch", "shard_by_work", "world_size", "wrap"]
