"""One rank of the DDP tests: ``python _ddp_worker.py RANK WORLD STORE_FILE OUT_DIR CASE...``.

Runs each case (see _ddp_cases.py) under DistributedDataParallel with gloo and writes
``OUT_DIR/CASE.rank{RANK}.pt``: final parameters and what happened on the way.
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ddp_cases  # noqa: E402

from batchcraft import distributed  # noqa: E402


def train(case: str, rank: int, world: int) -> dict:
    sents, model, plan, find_unused, optimizer = _ddp_cases.build(case)
    local_mean = case == "treelstm_local_mean"
    # the pitfall case: each rank normalises by its own work and DDP averages the gradients
    loss_module = distributed.AutobatchLoss(model, grad_scale=1.0 if local_mean else None)
    ddp = distributed.wrap(loss_module, find_unused_parameters=find_unused)
    opt = optimizer(ddp.parameters())
    batch_sizes, losses = [], []
    with Join([ddp]):
        for step, batch in enumerate(plan.rank_batches(rank)):
            instances = [sents[i] for i in batch]
            total = ddp(instances)
            norm = sum(plan.works[i] for i in batch) if local_mean else plan.global_work(step)
            loss = total / norm
            opt.zero_grad()
            loss.backward()
            opt.step()
            batch_sizes.append(loss_module.stats.instances)
            losses.append(float(total))
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "batch_sizes": batch_sizes, "losses": losses}


def main() -> int:
    rank, world, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    # a collective that one rank never joins fails after 60 s instead of hanging the test
    distributed.init("cpu", init_method=f"file://{store}", rank=rank, world_size=world,
                     timeout=datetime.timedelta(seconds=60))
    try:
        for case in sys.argv[5:]:
            result = train(case, rank, world)
            torch.save(result, os.path.join(out_dir, f"{case}.rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
