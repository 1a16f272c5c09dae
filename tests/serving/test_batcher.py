"""DynamicBatcher: batches closed by size, work or (fake) time; own results and errors; shutdown."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

import batchcraft
from batchcraft.models.treelstm import TreeLSTM
from batchcraft.serving import BatcherClosedError, DynamicBatcher

LIN = torch.nn.Linear(3, 2)
RESULT_TIMEOUT_S = 60  # generous: only a hang would take this long


def per_instance(x):
    if float(x[0]) > 100:
        raise ValueError("bad input")
    return torch.tanh(LIN(x))


class FakeClock:
    """Time moves only in advance(); the batcher re-reads it every few real milliseconds.

    The real poll interval changes only how soon the worker notices, never what it decides.
    """

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def wait(self, cond, timeout_s):
        cond.wait(0.002)

    def advance(self, dt):
        self.t += dt


def batcher_threads():
    return [t for t in threading.enumerate() if t.name.startswith("batchcraft-batcher")]


@pytest.fixture()
def clock():
    return FakeClock()


def test_full_batch_runs_without_waiting(clock):
    with DynamicBatcher(per_instance, max_batch_size=4, max_wait_s=10.0, clock=clock) as b:
        futs = [b.submit(torch.randn(3)) for _ in range(4)]
        [f.result(RESULT_TIMEOUT_S) for f in futs]       # no time passed: only size closed it
        assert b.stats.batch_sizes == [4]


def test_partial_batch_waits_for_max_wait(clock):
    with DynamicBatcher(per_instance, max_batch_size=8, max_wait_s=0.010, clock=clock) as b:
        futs = [b.submit(torch.randn(3)) for _ in range(3)]
        time.sleep(0.05)                                  # real time passes, fake time does not
        assert not any(f.done() for f in futs)
        clock.advance(0.009)
        time.sleep(0.02)
        assert not any(f.done() for f in futs)
        clock.advance(0.002)
        [f.result(RESULT_TIMEOUT_S) for f in futs]
        assert b.stats.batch_sizes == [3]


def test_work_budget_closes_batches(clock):
    sizes = [torch.randn(n) for n in (6, 6, 6, 3)]       # work = len(instance)
    f = batchcraft.autobatch(lambda x: x.sum())
    with DynamicBatcher(f, max_batch_size=32, max_batch_work=12, max_wait_s=10.0, clock=clock) as b:
        futs = [b.submit(x) for x in sizes]
        futs[0].result(RESULT_TIMEOUT_S)                  # 6 + 6 reach 12: full
        futs[1].result(RESULT_TIMEOUT_S)
        time.sleep(0.02)
        assert not futs[2].done()                         # 6 + 3 = 9 < 12: waits
        clock.advance(10.0)
        for x, fu in zip(sizes, futs):
            torch.testing.assert_close(fu.result(RESULT_TIMEOUT_S), x.sum())
        assert b.stats.batch_sizes == [2, 2]


def test_errors_fail_only_their_request():
    torch.manual_seed(1)
    xs = [torch.randn(3) for _ in range(12)]
    bad = {1, 6, 7}
    for i in bad:
        xs[i][0] = 1000.0
    with DynamicBatcher(per_instance, max_batch_size=12, max_wait_s=10.0) as b:
        futs = [b.submit(x) for x in xs]
        for i, (x, fu) in enumerate(zip(xs, futs)):
            if i in bad:
                with pytest.raises(ValueError, match="bad input"):
                    fu.result(RESULT_TIMEOUT_S)
            else:
                torch.testing.assert_close(fu.result(RESULT_TIMEOUT_S), per_instance(x))
    assert b.stats.failed == 3 and b.stats.batch_sizes == [12]


def test_many_threads_each_get_their_own_result():
    torch.manual_seed(2)
    xs = [torch.randn(3) for _ in range(160)]
    got = [None] * len(xs)
    with DynamicBatcher(per_instance, max_batch_size=16, max_wait_s=0.002) as b:
        def client(k):
            for i in range(k, len(xs), 8):
                got[i] = b(xs[i], timeout=RESULT_TIMEOUT_S)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for x, y in zip(xs, got):
        torch.testing.assert_close(y, per_instance(x))
    assert sum(b.stats.batch_sizes) == len(xs) and b.stats.requests == len(xs)


def test_real_model_results_equal_one_at_a_time(ud_sentences):
    torch.manual_seed(0)
    model = TreeLSTM(vocab_size=max(max(s.word_ids) for s in ud_sentences) + 1, hidden=16)
    sents = ud_sentences[:20]
    with DynamicBatcher(model, max_batch_size=8, max_batch_work=200, max_wait_s=0.005) as b:
        futs = [b.submit(s) for s in sents]
        outs = [f.result(RESULT_TIMEOUT_S) for f in futs]
    with torch.no_grad():
        for s, y in zip(sents, outs):
            torch.testing.assert_close(y, model(s), atol=1e-6, rtol=1e-5)
    assert max(b.stats.batch_sizes) > 1


def test_close_serves_waiting_requests_and_leaves_no_thread(clock):
    b = DynamicBatcher(per_instance, max_batch_size=100, max_wait_s=10.0, clock=clock)
    futs = [b.submit(torch.randn(3)) for _ in range(5)]
    b.close(timeout=RESULT_TIMEOUT_S)                     # no fake time passed: closing serves them
    assert all(f.done() and f.exception() is None for f in futs)
    assert b.closed and not batcher_threads()
    with pytest.raises(BatcherClosedError):
        b.submit(torch.randn(3))


def test_close_can_cancel_waiting_requests(clock):
    b = DynamicBatcher(per_instance, max_batch_size=100, max_wait_s=10.0, clock=clock)
    futs = [b.submit(torch.randn(3)) for _ in range(5)]
    b.close(cancel_pending=True, timeout=RESULT_TIMEOUT_S)
    for f in futs:
        with pytest.raises(CancelledError):
            f.result(0)
    assert not batcher_threads()


def test_cancelled_request_is_skipped(clock):
    with DynamicBatcher(per_instance, max_batch_size=3, max_wait_s=10.0, clock=clock) as b:
        first = b.submit(torch.randn(3))
        assert first.cancel()
        futs = [b.submit(torch.randn(3)) for _ in range(2)]
        [f.result(RESULT_TIMEOUT_S) for f in futs]
    assert b.stats.batch_sizes == [2]


def test_options_for_an_already_batched_fn_are_refused():
    with pytest.raises(ValueError, match="auto-batched already"):
        DynamicBatcher(batchcraft.autobatch(per_instance), scheduler="agenda")
