"""Kernel selection for batched linears (autobatching/kernels.py): choice, cache, measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchcraft.autobatching import kernels
from batchcraft.autobatching.kernels import LEAD, Selector, _Store, onednn_available, onednn_linear, race_us

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN linear in this torch build")


class FakeTimer:
    """Returns fixed times (default kernel, oneDNN) and counts measurements."""

    def __init__(self, t_default, t_onednn):
        self.times, self.calls = [t_default, t_onednn], 0

    def __call__(self, fns):
        self.calls += 1
        return list(self.times)


@needs_onednn
@pytest.mark.parametrize("t_onednn, choice", [(50.0, "onednn"), (100 / LEAD + 1, "default"), (150.0, "default")])
def test_the_faster_kernel_is_chosen_only_with_a_clear_lead(t_onednn, choice):
    sel = Selector("auto", None, timer=FakeTimer(100.0, t_onednn))
    x, w = torch.randn(70, 256), torch.randn(512, 256)
    assert sel.choose(x, w, None) == choice
    # oneDNN sums the 256 products in another order than MKL: float32 rounding, not exactness
    torch.testing.assert_close(sel.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)


@needs_onednn
def test_choices_are_measured_once_per_shape_class_and_persist(tmp_path):
    path = tmp_path / "kernels.sqlite"
    t = FakeTimer(100.0, 40.0)
    sel = Selector("auto", _Store(str(path)), timer=t)
    w = torch.randn(256, 128)
    for m in (65, 90, 128):  # one row bucket (<= 128)
        assert sel.choose(torch.randn(m, 128), w, None) == "onednn"
    assert t.calls == 1
    sel.choose(torch.randn(129, 128), w, None)  # the next bucket is measured on its own
    assert t.calls == 2
    t2 = FakeTimer(1.0, 1000.0)  # a new process: the stored choice holds, nothing is measured
    again = Selector("auto", _Store(str(path)), timer=t2)
    assert again.choose(torch.randn(100, 128), w, None) == "onednn" and t2.calls == 0


@needs_onednn
def test_inference_calls_reuse_the_choice_by_exact_shape_and_others_choose_each_time(monkeypatch):
    sel = Selector("auto", None, timer=FakeTimer(100.0, 40.0))
    chose = []
    original = Selector.choose
    monkeypatch.setattr(Selector, "choose", lambda self, *a: chose.append(1) or original(self, *a))
    x, w, b = torch.randn(70, 256), torch.randn(512, 256), torch.randn(512)
    calls = []
    monkeypatch.setattr(kernels, "onednn_linear", lambda *a: calls.append("onednn") or F.linear(*a))
    with torch.no_grad():
        for _ in range(3):
            sel.linear(x, w, b)
        sel.linear(x[:60], w, b)  # another shape: chosen once more
    assert len(chose) == 2 and calls == ["onednn"] * 4
    # grad mode, a torch-function mode and autocast each take the full choice every call
    xg = x.clone().requires_grad_()
    sel.linear(xg, w, b)
    class Passing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing(), torch.no_grad():
        sel.linear(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert sel.linear(x, w, b).dtype == torch.bfloat16  # autocast: torch's own linear
    assert len(chose) == 5 and calls == ["onednn"] * 6


@needs_onednn
def test_small_shape_classes_keep_the_default_without_measuring():
    t = FakeTimer(100.0, 1.0)
    sel = Selector("auto", None, timer=t)
    assert sel.choose(torch.randn(8, 16), torch.randn(8, 16), None) == "default"  # 2*8*16*8 FLOP
    assert t.calls == 0


def test_race_warms_each_function_then_interleaves_with_rotating_order():
    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    out = race_us(fns, rounds=3)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert len(out) == 2 and all(t >= 0 for t in out)


def test_modes_default_and_non_float32_never_measure():
    t = FakeTimer(100.0, 1.0)
    x, w = torch.randn(4, 3), torch.randn(2, 3)
    assert Selector("default", None, timer=t).choose(x, w, None) == "default"
    assert Selector("auto", None, timer=t).choose(x.double(), w.double(), None) == "default"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Selector("auto", None, timer=t).choose(x, w, None) == "default"
    assert t.calls == 0


@needs_onednn
def test_onednn_linear_matches_f_linear_in_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    g = torch.randn(5, 3, 8)
    out = onednn_linear(x, w, b)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ga = torch.autograd.grad((out * g).sum(), (x, w, b))
    gb = torch.autograd.grad((ref * g).sum(), (x, w, b))
    for a, r in zip(ga, gb):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


def test_tests_do_not_write_the_users_cache():
    # tests/conftest.py points BATCHCRAFT_CACHE_DIR at a session directory
    from pathlib import Path

    assert not kernels.default_cache_path().startswith(str(Path.home() / ".cache"))


@needs_onednn
def test_stats_count_the_kernel_measurements_of_a_call(monkeypatch):
    from batchcraft import autobatch

    sel = Selector("auto", None, timer=FakeTimer(100.0, 150.0))
    monkeypatch.setitem(kernels._SELECTORS, "auto", sel)
    lin = torch.nn.Linear(256, 512)
    f = autobatch(lambda x: lin(x))
    with torch.no_grad():
        f([torch.randn(256) for _ in range(40)])
        assert f.stats.kernels_measured == 1 and "kernel shape classes measured" in f.stats.summary()
        f([torch.randn(256) for _ in range(40)])  # the same shape class: chosen, not measured
        assert f.stats.kernels_measured == 0


@needs_onednn
def test_measuring_does_not_move_the_random_state_or_reach_user_modes():
    from torch.overrides import TorchFunctionMode

    class Spy(TorchFunctionMode):
        names: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Spy.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    sel = Selector("auto", None)  # the real timer
    torch.manual_seed(3)
    before = torch.get_rng_state()
    x, w = torch.ones(70, 256), torch.ones(512, 256)
    with Spy():
        sel.choose(x, w, None)
    assert torch.equal(torch.get_rng_state(), before)
    assert sel.n_measured == 1 and Spy.names == []


def test_onednn_is_asked_for_only_when_a_choice_needs_it(tmp_path, monkeypatch):
    # its first call costs a first auto-batched call 3-6 ms: a stored choice of the default kernel
    # needs no oneDNN; a stored oneDNN choice on a build without it falls back to the default
    asked = []

    def available(flag):
        def f():
            asked.append(flag)
            return flag
        return f

    path = str(tmp_path / "kernels.sqlite")
    x, w = torch.randn(100, 128), torch.randn(256, 128)
    first = Selector("auto", _Store(path), timer=FakeTimer(10.0, 100.0))
    monkeypatch.setattr(kernels, "onednn_available", available(True))
    assert first.choose(x, w, None) == "default" and asked == [True]  # measured: oneDNN needed
    asked.clear()
    again = Selector("auto", _Store(path), timer=FakeTimer(1.0, 1.0))
    assert again.choose(x, w, None) == "default" and asked == []  # stored default: never asked
    assert again.linear_for(None, None) == again.linear  # (not known to be missing: the selector's call)
    onednn_store = Selector("auto", _Store(str(tmp_path / "o.sqlite")), timer=FakeTimer(100.0, 10.0))
    assert onednn_store.choose(x, w, None) == "onednn"
    monkeypatch.setattr(kernels, "_lp", None)  # another build, without oneDNN, sharing the cache
    missing = Selector("auto", _Store(str(tmp_path / "o.sqlite")), timer=FakeTimer(1.0, 1.0))
    assert missing.choose(x, w, None) == "default"
    assert missing.linear_for(None, None) is kernels._LINEAR  # known missing now: torch's linear directly
    forced = Selector("onednn", None)
    assert forced.choose(x, w, None) == "default"


def test_a_passed_onednn_check_is_reused_only_under_the_same_runtime_settings(tmp_path, monkeypatch):
    # the process-wide check and the per-class one cost a first call about 5 ms: a pass is stored
    # with the settings that decide it (#211: OMP_THREAD_LIMIT, OMP_DYNAMIC), a failure never
    asked = []

    def check(name, result):
        def f(*args):
            asked.append(name)
            return result
        return f

    monkeypatch.setattr(kernels, "_onednn_built", lambda: True)
    monkeypatch.setattr(kernels, "onednn_available", check("available", True))
    monkeypatch.setattr(kernels, "_agrees", check("class", True))
    monkeypatch.delenv("OMP_THREAD_LIMIT", raising=False)
    path = str(tmp_path / "kernels.sqlite")
    x, w = torch.randn(100, 128), torch.randn(256, 128)

    def choose():
        return Selector("auto", _Store(path), timer=FakeTimer(100.0, 10.0)).choose(x, w, None)

    assert choose() == "onednn" and asked == ["available", "class"]
    assert choose() == "onednn" and asked == ["available", "class"]  # a new process: both stored
    fingerprint = kernels.runtime_fingerprint()
    monkeypatch.setenv("OMP_THREAD_LIMIT", "1")
    assert kernels.runtime_fingerprint() != fingerprint
    monkeypatch.setattr(kernels, "_agrees", check("class", False))
    assert choose() == "default" and asked[2:] == ["available", "class"]  # checked again: refused
    assert choose() == "default" and asked[4:] == ["class"]  # the pass was stored, the failure not
    monkeypatch.delenv("OMP_THREAD_LIMIT")
    assert choose() == "onednn" and len(asked) == 5
    monkeypatch.setattr(kernels, "_agrees", check("class", True))
    assert Selector("auto", None, timer=FakeTimer(100.0, 10.0)).choose(x, w, None) == "onednn"
    assert len(asked) == 7  # without a store every process checks


@needs_onednn
@pytest.mark.parametrize("how", ["jvp", "dual_level"])
def test_forward_mode_derivatives_keep_the_default_kernel(how):
    # reliability #206 (hostile helper, stop 41; present before): oneDNN's linear has no forward
    # derivative and torch gives its output a zero tangent, silently; under no_grad the inference
    # path chose it inside torch.func.jvp (wrong tangents of a TreeLSTM's input projection)
    import torch.autograd.forward_ad as fwAD

    from batchcraft import autobatch, static_block

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)

    @static_block
    def block(x, w, b):
        return torch.tanh(F.linear(x, w, b))

    xs = [torch.randn(64) for _ in range(40)]
    tw = torch.randn_like(lin.weight)
    f = autobatch(lambda x: block(x, lin.weight, lin.bias), kernels="onednn")  # always oneDNN where it may
    with torch.no_grad():
        if how == "jvp":
            def run(batched):
                def g(w):
                    fn = (lambda x: block(x, w, lin.bias))
                    return torch.stack(autobatch(fn, kernels="onednn")(xs) if batched else [fn(x) for x in xs])
                return torch.func.jvp(g, (lin.weight.detach(),), (tw,))[1]
            got, ref = run(True), run(False)
        else:
            with fwAD.dual_level():
                w = fwAD.make_dual(lin.weight.detach(), tw)
                fn = (lambda x: block(x, w, lin.bias))
                got = torch.stack([fwAD.unpack_dual(o).tangent for o in autobatch(fn, kernels="onednn")(xs)])
                ref = torch.stack([fwAD.unpack_dual(fn(x)).tangent for x in xs])
        assert ref.abs().max() > 0.1
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        out = f(xs)  # and outside forward AD the chosen kernel still runs
    torch.testing.assert_close(torch.stack(out), torch.stack([block(x, lin.weight, lin.bias) for x in xs]),
                               atol=1e-4, rtol=1e-4)


@needs_onednn
def test_the_choice_outside_forward_ad_does_not_follow_it_inside():
    import torch.autograd.forward_ad as fwAD

    sel = Selector("onednn", None)
    x, w = torch.randn(70, 256), torch.randn(512, 256)
    with torch.no_grad():
        assert sel.choose(x, w, None) == "onednn"
        sel.linear(x, w)  # (cached by shape for the inference path)
        with fwAD.dual_level():
            xd = fwAD.make_dual(x, torch.ones_like(x))
            assert sel.choose(xd, w, None) == "default"
            t = fwAD.unpack_dual(sel.linear(xd, w)).tangent
        torch.testing.assert_close(t, F.linear(torch.ones_like(x), w))


_LIMITED = r"""
import torch
torch.set_num_threads(2)
from batchcraft import autobatch
from batchcraft.autobatching import kernels
from batchcraft.autobatching.kernels import Selector
from batchcraft.data import load_sentences
from batchcraft.models import suite
from batchcraft.parallel import backends

import os

# OMP_DYNAMIC=true: libgomp gives a parallel region the CPUs less the load average, so oneDNN's rows
# go unwritten only while the machine is busy; there the checks refuse it, on an idle machine they
# pass and it is right. OMP_THREAD_LIMIT=1 leaves them unwritten always. Values must hold in both.
limited = os.environ.get("OMP_THREAD_LIMIT") == "1"
if limited:
    assert not kernels.onednn_available()
    assert "onednn" not in backends.available_matmul()
passes = []


class Stored:  # a choice another process of this machine measured and stored
    def get(self, key):
        return ("onednn", 100.0, 50.0)

    def put(self, *args):
        raise AssertionError("a refused choice is not stored")

    def passed(self, key):  # (no check passed under this environment before)
        return False

    def put_passed(self, key):
        passes.append(key)


s = Selector("auto", Stored())
s._onednn = True  # as if oneDNN had passed the process-wide check: the per-class check must still refuse
x, w, b = torch.randn(64, 256), torch.randn(768, 256), torch.randn(768)
with torch.no_grad():
    assert torch.allclose(s.linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-4)
assert not (limited and passes), passes  # a failed check is not stored
task = suite.build("treelstm", load_sentences(limit=40), hidden=256)
with torch.no_grad():
    want = torch.stack([task.fn(t) for t in task.instances])
    for mode in ("auto", "onednn"):
        got = torch.stack(autobatch(task.fn, kernels=mode)(task.instances))
        assert torch.allclose(got, want, atol=1e-5), (mode, (got - want).abs().max())
print("ok")
"""


@needs_onednn
@pytest.mark.parametrize("env", [{"OMP_THREAD_LIMIT": "1"}, {"OMP_DYNAMIC": "true"}], ids=["thread-limit", "dynamic"])
def test_onednn_is_refused_where_it_leaves_rows_unwritten(env, tmp_path):
    """Reliability #211 (hostile helper, stop 42): under OMP_THREAD_LIMIT=1 or OMP_DYNAMIC=true,
    torch's oneDNN linear on 2 threads leaves rows unwritten; kernels="auto" chose it, and an
    auto-batched TreeLSTM came out off by up to 0.87 (NaN for other models). (Under OMP_DYNAMIC
    only while the machine is busy: the test asserted the refusal and failed on an idle machine,
    stop 44.)"""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _LIMITED], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, BATCHCRAFT_CACHE_DIR=str(tmp_path), **env))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


_LATER = r"""
import sys
import torch
from batchcraft import autobatch
from batchcraft.parallel import backends

first, then = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(first)
torch.manual_seed(0)
lin = torch.nn.Linear(256, 512)
xs = [torch.randn(256) for _ in range(64)]
f = autobatch(lambda x: lin(x), kernels="onednn")
conv = backends.convert(torch.nn.Sequential(torch.nn.Linear(256, 768)), matmul="onednn") \
    if "onednn" in backends.available_matmul() else None
x2 = torch.randn(64, 256)
for t in (first, then):  # checked first where oneDNN is right; then at more threads
    torch.set_num_threads(t)
    with torch.no_grad():
        err = max((o - lin(x)).abs().max().item() for o, x in zip(f(xs), xs))
        assert err < 1e-4, (t, err)
        if conv is not None:
            err2 = (conv(x2) - torch.nn.functional.linear(x2, conv[0].weight, conv[0].bias)).abs().max().item()
            assert err2 < 1e-4, (t, err2)
print("ok" if conv is not None or first == 1 else "no backend")
"""


@needs_onednn
@pytest.mark.parametrize("limit,first,then", [(1, 1, 2), (2, 2, 4)])
def test_onednn_is_checked_again_at_a_later_thread_count(limit, first, then):
    """Reliability #213 (hostile helper, stop 42, present before): kernels="onednn" and the Spread
    backends' oneDNN linear were checked at the first thread count only; under OMP_THREAD_LIMIT,
    more threads afterwards brought back oneDNN's unwritten rows (off by 135)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _LATER, str(first), str(then)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_THREAD_LIMIT=str(limit)))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_passes_are_keyed_by_the_runtimes_own_state_and_never_stored_under_dynamic_threads(tmp_path, monkeypatch):
    # hostile pass, stop 44: the fingerprint read os.environ, which the OpenMP runtime read once at
    # load; and under OMP_DYNAMIC a check passed while idle was reused while busy (wrong values)
    state = [(0, 2147483647, 2, 2147483647, 0)]
    monkeypatch.setattr(kernels._openmp, "runtime_state", lambda: state[0])
    free = kernels.runtime_fingerprint()
    state[0] = (0, 4, 2, 2147483647, 0)  # OMP_THREAD_LIMIT=4 as the runtime read it, whatever os.environ says
    assert kernels.runtime_fingerprint() not in (None, free)
    for dynamic in ((1, 2147483647, 2, 2147483647, 0), (0, 1, 2, 2147483647, 0), None):  # dynamic; limited; none
        state[0] = dynamic
        assert kernels.runtime_fingerprint() is None
    asked = []
    monkeypatch.setattr(kernels, "_onednn_built", lambda: True)
    monkeypatch.setattr(kernels, "onednn_available", lambda: asked.append("available") or True)
    monkeypatch.setattr(kernels, "_agrees", lambda *a: asked.append("class") or True)
    path = str(tmp_path / "kernels.sqlite")
    x, w = torch.randn(100, 128), torch.randn(256, 128)
    for _ in range(2):
        assert Selector("auto", _Store(path), timer=FakeTimer(100.0, 10.0)).choose(x, w, None) == "onednn"
    assert asked == ["available", "class"] * 2  # checked in each process, nothing stored
    import sqlite3

    assert sqlite3.connect(path).execute(f"SELECT COUNT(*) FROM {kernels.CHECKS}").fetchone()[0] == 0


_RUN = r"""
import os, sys, torch
torch.set_num_threads(2)
if sys.argv[1] == "set-late":
    os.environ["OMP_THREAD_LIMIT"] = "1"  # after the OpenMP runtime has loaded: it never sees this
elif sys.argv[1] == "unset-late":
    os.environ.pop("OMP_THREAD_LIMIT", None)  # the runtime keeps the limit it read
from batchcraft import autobatch
from batchcraft.autobatching import kernels
from batchcraft.data import load_sentences
from batchcraft.models import suite

kernels.selector("auto").timer = lambda fns: [100.0, 10.0]  # measured: oneDNN wins every class
task = suite.build("treelstm", load_sentences(limit=40), hidden=256)
with torch.no_grad():
    want = torch.stack([task.fn(t) for t in task.instances])
    got = torch.stack(autobatch(task.fn)(task.instances))
print("ok" if torch.allclose(got, want, atol=1e-5) else f"off by {(got - want).abs().max():.3g}")
"""


@needs_onednn
def test_a_pass_stored_under_another_runtime_state_is_not_trusted(tmp_path):
    import os
    import subprocess
    import sys

    def run(how, **env):
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_THREAD_LIMIT", "OMP_DYNAMIC")}
        r = subprocess.run([sys.executable, "-c", _RUN, how], capture_output=True, text=True, timeout=600,
                           env=dict(base, BATCHCRAFT_CACHE_DIR=str(tmp_path), **env))
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip().splitlines()[-1]

    # passes stored by a process that set OMP_THREAD_LIMIT too late, then a process really limited
    assert run("set-late") == "ok"
    assert run("plain", OMP_THREAD_LIMIT="1") == "ok"
    # passes stored by an unlimited process, then a limited one that removed the variable
    assert run("plain") == "ok"
    assert run("unset-late", OMP_THREAD_LIMIT="1") == "ok"


def test_onednn_runs_only_where_its_openmp_team_is_full(monkeypatch):
    # reliability #223 (hostile pass, stop 44; present before in the process's own choices): after a
    # first call chose oneDNN, omp_set_dynamic(1) or omp_set_max_active_levels(0) left rows unwritten
    from batchcraft.autobatching import openmp

    assert openmp.full_team((0, 2147483647, 2, 2147483647, 0))
    for bad in ((1, 2147483647, 2, 2147483647, 0), (0, 1, 2, 2147483647, 0), (0, 2147483647, 2, 0, 0),
                (0, 2147483647, 2, 2147483647, 1)):
        assert not openmp.full_team(bad)
    state = [(0, 2147483647, 2, 2147483647, 0)]
    monkeypatch.setattr(openmp, "runtime_state", lambda: state[0])
    calls = []
    monkeypatch.setattr(kernels, "onednn_linear", lambda *a: calls.append("onednn") or F.linear(*a))
    sel = Selector("onednn", None)
    sel.choices = {}
    monkeypatch.setattr(sel, "choose", lambda *a: "onednn")
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with torch.no_grad():
        sel.linear(x, w)
        state[0] = (1, 2147483647, 2, 2147483647, 0)
        torch.testing.assert_close(sel.linear(x, w), F.linear(x, w))
    assert calls == ["onednn"]
    assert kernels.runtime_fingerprint() is None
    state[0] = None  # no runtime to ask: the agreement checks alone decide, nothing is stored
    assert openmp.team_ok() and kernels.runtime_fingerprint() is None


_TEAM = r"""
import ctypes, os, sys, torch
torch.set_num_threads(2)
from batchcraft import autobatch
from batchcraft.autobatching import kernels, openmp
from batchcraft.data import load_sentences
from batchcraft.models import suite

kernels.selector("auto").timer = lambda fns: [100.0, 10.0]  # measured: oneDNN wins every class
if openmp.find() is None:
    print("skip: no OpenMP runtime of torch's"); sys.exit(0)
mode = os.RTLD_NOLOAD | os.RTLD_LAZY


def loaded(name):
    try:
        return ctypes.CDLL(name, mode=mode)
    except OSError:  # not in the process
        return None


rt = next(lib for lib in map(loaded, openmp.SONAMES) if lib is not None)
task = suite.build("treelstm", load_sentences(limit=40), hidden=256)


def wrong():
    with torch.no_grad():
        want = [task.fn(t) for t in task.instances]
        got = autobatch(task.fn)(task.instances)
    return sum(not torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


assert wrong() == 0  # oneDNN chosen and checked (its passes stored)
getattr(rt, sys.argv[1])(int(sys.argv[2]))
assert wrong() == 0, sys.argv[1:]
print("ok")
"""


@needs_onednn
@pytest.mark.parametrize("call", [("omp_set_dynamic", 1), ("omp_set_max_active_levels", 0)],
                         ids=["dynamic", "no-active-levels"])
def test_a_runtime_change_of_the_openmp_team_after_a_first_call_keeps_values_right(call, tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, BATCHCRAFT_CACHE_DIR=str(tmp_path))
    for k in ("OMP_THREAD_LIMIT", "OMP_DYNAMIC", "OMP_MAX_ACTIVE_LEVELS"):
        env.pop(k, None)
    for _ in range(2):  # the second process starts from the passes the first stored
        r = subprocess.run([sys.executable, "-c", _TEAM, call[0], str(call[1])], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] in ("ok", "skip: no OpenMP runtime of torch's"), \
            r.stderr[-3000:]
