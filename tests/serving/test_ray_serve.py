"""The Ray Serve deployment answers requests in a local Ray, batched, with per-request errors.

Starts a local Ray (2 CPUs, no dashboard) and shuts it down at the end; nothing keeps running.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from batchcraft.models.treelstm import TreeLSTM  # noqa: E402
from batchcraft.serving.ray_serve import deployment  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    before = set(_live_children())  # e.g. multiprocessing's resource tracker from earlier tests
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        # handles only, no HTTP proxy: on a busy machine the proxy's health check can time out
        # and Serve kills it before it starts, failing serve.run (seen next to two CPU hogs)
        serve.start(proxy_location="Disabled")
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
    # ray.shutdown() signals its processes and returns; they exit within seconds (longer on a busy
    # machine), so wait for them rather than sample once.
    deadline = time.monotonic() + 60
    while set(_live_children()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = set(_live_children()) - before
    assert not left, f"Ray left processes running: {sorted(left)}"


def _live_children() -> list[tuple]:
    """(pid, command line) of this process's children that are still running (not zombies)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
            if int(fields[1]) != os.getpid() or fields[0] == "Z":
                continue
            cmd = open(stat.replace("stat", "cmdline"), "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        out.append((int(stat.split("/")[2]), cmd.strip()[:200]))
    return out


@pytest.mark.slow
def test_deployment_serves_treelstm_in_batches_with_own_errors(local_ray, ud_sentences):
    torch.manual_seed(0)
    model = TreeLSTM(vocab_size=max(max(s.word_ids) for s in ud_sentences) + 1, hidden=16)
    model.eval()

    def fn(s):  # pickled by value into the replica, with the model
        if s.sent_id == "bad":
            raise ValueError("refused: bad sentence")
        return model(s)

    sents = [ud_sentences[i] for i in range(24)]
    bad = ud_sentences[30]
    bad.sent_id = "bad"
    handle = serve.run(deployment(fn, max_batch_size=8, max_batch_work=120,
                                  batch_wait_timeout_s=0.05, ray_actor_options={"num_cpus": 0}),
                       name="bc-test", route_prefix=None)
    responses = [handle.remote(s) for s in sents[:12]] + [handle.remote(bad)] + \
        [handle.remote(s) for s in sents[12:]]
    with pytest.raises(Exception, match="refused: bad sentence"):
        responses[12].result(timeout_s=120)
    outs = [r.result(timeout_s=120) for i, r in enumerate(responses) if i != 12]
    with torch.no_grad():
        for s, y in zip(sents, outs):
            torch.testing.assert_close(y, model(s), atol=1e-6, rtol=1e-5)
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["requests"] >= 25 and 1 < max(stats["batch_sizes"]) <= 8
