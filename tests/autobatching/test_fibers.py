"""Tensor-dependent control flow: fibers yield on values, batch, resume (ACRoBat §5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchcraft
from batchcraft import autobatch
from batchcraft.errors import InstanceError, StepLimitError

from equivalence import CORES, assert_matches_eager

torch.manual_seed(0)
CELL = nn.GRUCell(8, 8)
HEAD = nn.Linear(8, 1)
PARAMS = list(CELL.parameters()) + list(HEAD.parameters())


def early_exit(x):
    """Iterate until the exit score passes 0, at most 12 steps: paths differ per instance."""
    h = torch.zeros(8)
    for step in range(12):
        h = CELL(x, h)
        score = HEAD(h)
        if score > 0:  # bool() of a tensor: the fiber yields here
            break
    return h * (step + 1)


def test_early_exit_matches_eager_and_paths_differ():
    g = torch.Generator().manual_seed(0)  # own stream: not whatever earlier tests left behind
    xs = [torch.randn(8, generator=g) * s for s in (0.1, 1, 3, 0.5, 2, 5, 0.2, 1.5)]
    f = assert_matches_eager(early_exit, xs, PARAMS)
    steps = []
    for x in xs:
        h = torch.zeros(8)
        for step in range(12):
            h = CELL(x, h)
            if HEAD(h) > 0:
                break
        steps.append(step)
    assert len(set(steps)) > 1, "test data must take different paths"
    assert f.stats.syncs >= max(steps)
    assert f.stats.mean_batch > 2


@pytest.mark.parametrize("how", ["item", "int", "index", "tolist", "while"])
def test_value_requests_of_every_kind(how):
    table = [10.0, 20.0, 30.0, 40.0]

    def fn(x):
        k = (x.sum() > 0).long() + (x.abs().sum() > 3).long()
        if how == "item":
            return x * k.item()
        if how == "int":
            return x * int(k)
        if how == "index":
            return x * table[k]
        if how == "tolist":
            return x * sum(k.reshape(1).tolist())
        n = torch.zeros(())
        while n < k:  # `while` on a tensor
            n = n + 1
        return x * n

    xs = [torch.randn(3) * s for s in (0.5, 2, 4, 1)]
    out = autobatch(fn)(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, fn(x))


def test_no_work_is_executed_twice():
    calls = []
    lin = nn.Linear(4, 4)

    def fn(x):
        y = lin(x)
        if y.sum() > 0:
            y = lin(y)
        return y

    f = autobatch(fn)
    xs = [torch.randn(4) for _ in range(10)]
    f(xs)
    # one group for the first linear (+ the sum/compare), then one for the taken branch
    assert f.stats.ops_recorded == sum(1 for _ in xs) * 3 + sum(1 for x in xs if lin(x).sum() > 0)
    assert f.stats.batched_calls <= 4
    del calls


def test_exception_inside_a_fiber_names_the_instance():
    def fn(x):
        if x.sum() > 100:
            raise RuntimeError("too big")
        return x

    with pytest.raises(InstanceError) as ei:
        autobatch(fn)([torch.ones(2), torch.full((2,), 60.0), torch.ones(2)])
    assert ei.value.instance == 1 and "too big" in str(ei.value)


def test_step_limit_stops_a_fiber_that_never_finishes():
    def forever(x):
        while x.sum() > -1:  # never false for these inputs
            x = x + 1
        return x

    with pytest.raises(StepLimitError, match="max_steps=50"):
        autobatch(forever, max_steps=50)([torch.zeros(2), torch.ones(2)])


def test_without_fibers_value_requests_still_give_correct_results():
    xs = [torch.randn(8) for _ in range(5)]
    f = autobatch(early_exit, fibers=False)
    for o, x in zip(f(xs), xs):
        torch.testing.assert_close(o, early_exit(x))


def test_factory_calls_after_a_yield_are_still_batched():
    emb = nn.Embedding(50, 4)

    def fn(x):
        if x.sum() > 0:
            ids = [1, 2, 3]
        else:
            ids = [4, 5]
        return torch.stack([emb(torch.tensor(i)) for i in ids]).sum(0)

    xs = [torch.randn(3) for _ in range(8)]
    f = autobatch(fn)
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, fn(x))
    assert f.stats.groups_by_rule.get("weight") == 1  # all lookups, both branches, one call


def branchy(x):
    if x.sum() > 0:  # branches of different lengths
        y = torch.tanh(torch.sin(torch.cos(x)))
    else:
        y = torch.relu(x)
    return HEAD(CELL(y, y))  # the common tail should batch across both branches


def test_agenda_aligns_work_after_branches_of_different_lengths():
    g = torch.Generator().manual_seed(7)
    xs = [torch.rand(8, generator=g) * (1 if i % 3 else -1) for i in range(12)]  # both branches taken
    fd = assert_matches_eager(branchy, xs, PARAMS, scheduler="depth")
    fa = assert_matches_eager(branchy, xs, PARAMS, scheduler="agenda")
    assert fa.stats.batched_calls < fd.stats.batched_calls


def test_phases_schedule_each_phase_on_its_own():
    lin = nn.Linear(4, 4)
    cls = nn.Linear(4, 3)

    def make(use_phase):
        def fn(x):
            h = x[0]
            for t in range(1, x.shape[0]):  # encoder of instance-dependent length
                h = torch.tanh(lin(h) + x[t])
            if use_phase:
                batchcraft.phase("classifier")
            return cls(h).softmax(-1)
        return fn

    xs = [torch.randn(n, 4) for n in (1, 3, 6, 2)]
    params = list(lin.parameters()) + list(cls.parameters())
    with_phase = assert_matches_eager(make(True), xs, params)
    without = assert_matches_eager(make(False), xs, params)
    # encoders end at 4 different depths: without phases the classifier (linear + softmax) runs
    # in 4 groups each; with a phase boundary it runs once for all instances
    assert without.stats.batched_calls - with_phase.stats.batched_calls == 2 * (4 - 1)


def test_instances_that_never_wait_share_one_fiber_and_start_from_the_callers_state():
    # runner fibers are reused (a greenlet's first switch costs ~6 µs): what one instance left
    # behind (grad mode, a context variable, the default dtype) must not reach the next one
    import contextvars

    import greenlet

    var = contextvars.ContextVar("batchcraft_test_var", default="caller")
    seen = []

    def f(x):
        seen.append((id(greenlet.getcurrent()), var.get(), torch.is_grad_enabled(), torch.get_default_dtype()))
        var.set("instance")
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        return x * 2

    xs = [torch.randn(3) for _ in range(6)]
    out = autobatch(f)(xs)
    assert all(torch.equal(o, x * 2) for o, x in zip(out, xs))
    assert len({s[0] for s in seen}) == 1  # one fiber ran them all
    assert all(s[1:] == ("caller", True, torch.float32) for s in seen)
    assert var.get() == "caller" and torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


def test_waiting_instances_each_keep_a_fiber_and_finished_ones_free_theirs():
    import greenlet

    fibers = {}

    def f(x):
        fibers.setdefault(int(x[0].item() > 0), set()).add(id(greenlet.getcurrent()))  # a value wait
        h = x
        for _ in range(int(x[1].item()) % 3):
            if h.sum() > 100:  # another wait per step
                break
            h = torch.tanh(h) + 1
        return h

    xs = [torch.tensor([(-1.0) ** i, float(i), 0.5]) for i in range(8)]
    out = autobatch(f)(xs)
    assert sum(len(v) for v in fibers.values()) == 8  # each waited at its first line: its own fiber
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, f(x))


def test_an_error_after_finished_instances_unwinds_and_the_next_call_works():
    def f(x):
        if x.sum() > 0:  # a wait: the others finished first on their fibers
            raise ValueError("boom")
        return x + 1

    xs = [torch.full((2,), -1.0)] * 3 + [torch.ones(2)] + [torch.full((2,), -2.0)] * 3
    with pytest.raises(InstanceError, match="boom") as info:
        autobatch(f)(xs)
    assert info.value.instance == 3
    g = autobatch(f)
    out = g([x for x in xs if x.sum() <= 0])
    assert all(torch.equal(o, x + 1) for o, x in zip(out, [x for x in xs if x.sum() <= 0]))


_WAIT_IN_TORCHS_PARSER = """
import sys, torch
from batchcraft import autobatch
from batchcraft.errors import InstanceError

class Size:  # a size whose __index__ needs a value: the fiber waits inside torch's C++ parser
    def __init__(self, t):
        self.t = t
    def __index__(self):
        return int(self.t.item())

def f(x):
    z = torch.zeros(Size((x * 1).sum()), 2)
    if float(x) > 2.5:
        raise ValueError("boom")
    return z.sum() + x

for core in sys.argv[1:]:
    try:
        autobatch(f, core=core)([torch.tensor(2.0), torch.tensor(3.0), torch.tensor(1.0), torch.tensor(4.0)])
    except InstanceError as e:
        assert e.instance == 1 and "boom" in str(e), e
    else:
        raise AssertionError("no error")
    out = autobatch(f, core=core)([torch.tensor(2.0), torch.tensor(1.0)])
    assert [float(o) for o in out] == [2.0, 1.0], out
print("ok")
"""


@pytest.mark.parametrize("core", CORES)
def test_an_error_unwinds_fibers_waiting_inside_torchs_parser(core, tmp_path):
    # reliability #270: the fibers after the failing instance, suspended in a value wait that
    # torch's argument parser reached (an __index__), were unwound with greenlet's throw(); torch
    # then built its TypeError there, and the backtrace it takes crashed the process (SIGSEGV)
    import subprocess
    import sys

    script = tmp_path / "wait_in_parser.py"
    script.write_text(_WAIT_IN_TORCHS_PARSER)
    done = subprocess.run([sys.executable, str(script), core], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_a_value_wait_inside_a_greenlet_of_the_instance_code_resumes_that_greenlet():
    # reliability #75: the scheduler resumed the instance's fiber, so the child greenlet's
    # switch() returned () in it and every instance returned () silently
    import greenlet

    w = torch.randn(3, 3)

    def f(x):
        def body():
            v = torch.tanh(x @ w)
            if v.sum() > 0:  # a value wait inside the child greenlet
                v = v * 2
            greenlet.getcurrent().parent.switch(v)

        return greenlet.greenlet(body).switch() + 1

    xs = [torch.randn(3) for _ in range(6)]
    out = autobatch(f)(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, f(x))


def test_auto_fibers_run_in_sequence_after_a_call_without_waits_and_return_to_fibers_for_good():
    lin = nn.Linear(3, 3)
    wait = {"on": False}

    def f(x):
        h = torch.tanh(lin(x))
        if wait["on"] and h.sum() > -100:  # a value wait, in some calls only
            h = h * 2
        return h

    xs = [torch.randn(3) for _ in range(4)]
    g = autobatch(f)  # fibers="auto", the default
    seen = []
    for on in (False, False, True, False):
        wait["on"] = on
        out = g(xs)
        seen.append((g.stats.fibers, g.stats.syncs > 0))
        for o, x in zip(out, xs):
            torch.testing.assert_close(o, f(x))
    # first call in fibers (nothing known); no wait -> in sequence; a wait there (flushed, correct)
    # -> fibers for good
    assert seen == [(True, False), (False, False), (False, True), (True, False)]
    assert "in sequence" not in g.stats.summary()
    g2 = autobatch(f, fibers=True)
    wait["on"] = False
    g2(xs), g2(xs)
    assert g2.stats.fibers
    with pytest.raises(ValueError, match="fibers"):
        autobatch(f, fibers="yes")


@pytest.mark.parametrize("fibers", [True, False, "auto"])
def test_an_error_of_other_work_at_a_value_request_ends_the_call(fibers):
    # hostile pass, stop 36: run one after another, pending work executes inside the instance
    # code that asked for a value; its `except` caught another instance's error (a silent wrong
    # result, or an internal error when its output depended on the failed work)
    emb = nn.Embedding(5, 3)

    def f(i):
        e = emb(torch.tensor(i))  # id 7 is out of range: fails when the batched lookup runs
        if i != 7:
            try:
                float(e.sum())
            except RuntimeError:
                return torch.tensor(-1.0)
        return e.sum()

    g = autobatch(f, fibers=fibers)
    g([1, 2]), g([1, 2])  # values requested, nothing fails
    g2 = autobatch(lambda i: emb(torch.tensor(i)).sum(), fibers=fibers)
    g2([1, 2])
    with pytest.raises(InstanceError) as info:
        g2.fn = f  # (the same function object, now after a call without waits: "auto" runs in sequence)
        g2([7, 1, 2])
    assert info.value.instance == 0
    with pytest.raises(InstanceError) as info:
        g([7, 1, 2])
    assert info.value.instance == 0


@pytest.mark.parametrize("fibers", [True, False, "auto"])
def test_state_an_instance_leaves_changed_does_not_reach_the_next_in_any_mode(fibers):
    import contextvars

    scale = contextvars.ContextVar("scale", default=1)

    def f(x):
        s = scale.get()
        scale.set(s + 1)  # left set by the instance
        y = x * s
        torch.set_grad_enabled(False)  # left changed by the instance
        return y

    xs = [torch.ones(2, requires_grad=True) for _ in range(3)]
    g = autobatch(f, fibers=fibers)
    for _ in range(3):  # "auto": fibers, then one after another
        out = g(xs)
        assert [float(o[0]) for o in out] == [1.0, 1.0, 1.0] and all(o.requires_grad for o in out)
        assert scale.get() == 1 and torch.is_grad_enabled()


def test_an_empty_call_does_not_decide_auto_fibers():
    def f(x):
        return x * 2 if float(x.sum()) > 0 else x

    g = autobatch(f)
    g([])
    g([torch.ones(2)] * 4)
    assert g.stats.fibers and g.stats.syncs == 1


def test_auto_fibers_accept_an_array_of_instances():
    np = pytest.importorskip("numpy")
    g = autobatch(lambda x: torch.tensor(float(x)) * 2)
    for _ in range(2):  # (the second call decides from the first: an array has no truth value)
        assert [float(o) for o in g(np.array([1, 2, 3]))] == [2.0, 4.0, 6.0]
