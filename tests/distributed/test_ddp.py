"""2 ranks on localhost (gloo) train auto-batched models; parameters equal one process on the union.

One pair of worker processes runs every case (process start-up and gloo set-up dominate, so they
are paid once); the references run here. Float32 tolerance: the ranks batch different subsets, so
sums are rounded in another order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import _ddp_cases
from batchcraft import distributed
from batchcraft.errors import ConfigurationError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ddp_worker.py")
CASES = ["treelstm", "berxit", "treelstm_uneven", "treelstm_local_mean"]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    store = out / "store"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), "2", str(store), str(out), *CASES],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True) for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    def load(case, rank):
        return torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)

    return load


def assert_params_close(got: dict, want: dict, atol=2e-5, rtol=1e-4):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("case", ["treelstm", "berxit", "treelstm_uneven"])
def test_two_ranks_equal_one_process_on_union(ranks, case):
    r0, r1 = ranks(case, 0), ranks(case, 1)
    want = _ddp_cases.reference(case)
    assert_params_close(r0["params"], want)
    assert_params_close(r1["params"], want)
    # and the run did train: parameters moved away from the initial ones
    init = _ddp_cases.reference(case, steps=0)
    assert any((want[k] - init[k]).abs().max() > 1e-3 for k in want)


def test_each_step_is_one_autobatch_call_over_the_rank_shard(ranks):
    _, _, plan, _, _ = _ddp_cases.build("treelstm")
    for rank in range(2):
        assert ranks("treelstm", rank)["batch_sizes"] == [len(b) for b in plan.rank_batches(rank)]


def test_uneven_shards_finish_through_join(ranks):
    # rank 1 had one batch, rank 0 three; both returned (no hang) and agree
    r0, r1 = ranks("treelstm_uneven", 0), ranks("treelstm_uneven", 1)
    assert len(r0["losses"]) == 3 and len(r1["losses"]) == 1
    assert_params_close(r0["params"], r1["params"], atol=0, rtol=0)


def test_berxit_leaves_parameters_unused_and_they_keep_one_process_semantics(ranks):
    # with find_unused_parameters the exit heads no instance left by get no update at all (the
    # weight decay of a zero gradient would move them): same as in one process
    _, model, *_ = _ddp_cases.build("berxit")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    got = ranks("berxit", 0)["params"]
    untouched = [k for k in init if torch.equal(init[k], got[k]) and "exits" in k]
    assert untouched, "expected some exit head to be unused in every step"


def test_local_mean_normalisation_is_the_pitfall(ranks):
    # each rank dividing by its own work, with DDP averaging: mean of means, not the union mean
    want = _ddp_cases.reference("treelstm")
    got = ranks("treelstm_local_mean", 0)["params"]
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst > 1e-4


@pytest.fixture()
def one_rank_group(tmp_path):
    """A one-rank gloo group in this process (nothing to wait for, so nothing can hang)."""
    distributed.init("cpu", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_calling_ddp_once_per_instance_fails(one_rank_group):
    sents, model, plan, _, _ = _ddp_cases.build("berxit")
    ddp = distributed.wrap(distributed.AutobatchLoss(model), find_unused_parameters=True)
    with pytest.raises(TypeError, match="list of this rank's instances"):
        ddp(sents[0])
    # several DDP forwards before one backward, with find_unused_parameters=True: DDP refuses
    # (each forward marks the parameters its own output does not reach as ready)
    loss = sum(ddp([s]) for s in sents[:6])
    with pytest.raises(RuntimeError, match="mark a variable ready only once"):
        loss.backward()
    # one forward over the same instances is one autobatch call and trains
    ddp = distributed.wrap(distributed.AutobatchLoss(model), find_unused_parameters=True)
    ddp(sents[:6]).backward()
    assert ddp.module.stats.instances == 6


def test_wrap_without_process_group_says_how():
    with pytest.raises(ConfigurationError, match="init"):
        distributed.wrap(torch.nn.Linear(2, 2))


def test_init_without_rendezvous_says_how(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigurationError, match="torchrun"):
        distributed.init("cpu")
