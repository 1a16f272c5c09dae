"""End-to-end verification: the whole model is raced with the plan, the undivided plan and the default;
the fastest admissible one is kept, recorded in ``plan.verification``, and the budget still holds."""

import copy
import json

import pytest
import torch
from torch import nn

from batchcraft.microbatching import MeasurementCache, PlannedConv2d, WorkspaceAudit, microbatch, parse_budget
from batchcraft.microbatching import verify as verify_mod
from batchcraft.microbatching.cache import MeasurementRecord
from batchcraft.microbatching.measure import Measurer
from batchcraft.microbatching.planner import find_convolutions
from batchcraft.microbatching.verify import verify_plan

FAST = ("default", "im2col", "onednn_channels_last")
BATCH = 8


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def _x():
    return torch.randn(BATCH, 3, 12, 12, generator=torch.Generator().manual_seed(1))


def _cache_favouring_division(tmp_path) -> MeasurementCache:
    """A cache whose im2col micro-batches of 2 look almost free: the optimiser then always divides."""
    cache = MeasurementCache(tmp_path / "c.sqlite")
    microbatch(_net(), _x(), "64MiB", algorithms=FAST, repeats=1, progress=False, cache=cache,
               confirm=False, verify=False)  # fills the cache with real measurements
    m = Measurer(cache)
    convs, _ = find_convolutions(_net(), _x())
    for call in convs:
        geom = call.geometry
        for p in ("forward", "backward_data", "backward_filter"):
            real = cache.get(m.key(geom, p, "im2col", 2, True))
            cache.put(m.key(geom, p, "im2col", 2, True), MeasurementRecord(1e-6, 1, real.workspace_bytes))
    return cache


def _steps_timer(slow_if_divided: float, undivided_ms: float, default_ms: float, seen: list):
    """A fake clock that reads which steps are installed (not the variant's name) to decide the time."""
    def timer(variant, fn):
        fn()
        steps = [s for m in seen[0].modules() if isinstance(m, PlannedConv2d) for ss in m.steps.values() for s in ss]
        seen.append((variant, steps))
        if any(n < BATCH for _, n in steps):
            return slow_if_divided
        return default_ms if all(a == "default" for a, _ in steps) else undivided_ms
    return timer


@pytest.fixture(autouse=True)
def _no_recheck(monkeypatch):
    # these tests fake the clock to test which variant is kept; the fake times contradict the (faked)
    # per-layer times on purpose, which the disagreement check (test_trust.py) would act on
    monkeypatch.setattr(verify_mod, "disagreement", lambda *a, **k: None)


def _plan(model, cache, limit="64MiB", **kw):
    return microbatch(model, _x(), limit, algorithms=FAST, repeats=1, progress=False, cache=cache,
                      confirm=False, verify_repeats=3, **kw)


def _run(model, x):
    x = x.clone().requires_grad_()
    model.eval()  # dropout off: the two models must see the same function
    y = model(x)
    y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["wr", "wd"])
def test_a_slower_plan_is_replaced_by_the_undivided_one(policy, tmp_path, monkeypatch):
    cache = _cache_favouring_division(tmp_path)
    raw = _plan(_net(), cache, verify=False, policy=policy).plan
    assert any(len(pp.choice.steps) > 1 for _, _, pp in raw.pass_plans()), "the optimiser should divide"

    model = _net()
    seen = [model]
    # the plan (divided) is slow, the undivided plan fastest, the default in between
    monkeypatch.setattr(verify_mod, "wall_clock_ms", _steps_timer(30.0, 10.0, 20.0, seen))
    planned = _plan(model, cache, policy=policy)
    v = planned.plan.verification
    assert v.kept == "undivided"
    assert v.times_ms == {"default": 20.0, "undivided": 10.0, "planned": 30.0}
    assert v.mode == "training" and v.repeats == 3
    table = planned.plan.table()  # says plainly why it shows no division, and shows the optimiser's plan
    assert table.startswith("verification kept the best undivided plan (no layer is divided)")
    assert "optimiser's division" in table and "im2col 2x4" in table
    for (name, p, pp), (_, _, pp_raw) in zip(planned.plan.pass_plans(), raw.pass_plans()):
        assert pp.choice.steps == pp.undivided_choice.steps, (name, p)
        assert pp.choice.micro_batches == (BATCH,)
        assert pp.workspace_bytes <= parse_budget("64MiB")
    if policy == "wd":
        assert planned.plan.total_workspace_bytes <= parse_budget("64MiB")
    assert any(pp.optimizer_choice is not None and len(pp.optimizer_choice.steps) > 1
               for _, _, pp in planned.plan.pass_plans())
    # the modules run what the plan says
    for m in planned.modules():
        if isinstance(m, PlannedConv2d):
            layer = next(layer for layer in planned.plan.layers if layer.name == m.layer_name)
            assert m.steps == {p: pp.steps() for p, pp in layer.passes.items()}
    # each timed call ran the steps of the variant it was attributed to
    for variant, steps in seen[1:]:
        assert (variant == "planned") == any(n < BATCH for _, n in steps), variant
        assert (variant == "default") == all(a == "default" for a, _ in steps), variant
    # and it still computes the same values and gradients
    y0, dx0, g0 = _run(_net(), _x())
    y1, dx1, g1 = _run(planned, _x())
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-3, atol=1e-5)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-3, atol=1e-5, msg=k)
    d = json.loads(planned.plan.to_json())
    assert d["verification"]["kept"] == "undivided" and d["verification"]["speedup_vs_default"] == 2.0
    assert "undivided (kept)" in planned.plan.verification_table()


def test_a_faster_plan_is_kept_and_a_near_tie_goes_to_the_simpler(tmp_path, monkeypatch):
    cache = _cache_favouring_division(tmp_path)
    seen = [None]
    monkeypatch.setattr(verify_mod, "wall_clock_ms", _steps_timer(10.0, 20.0, 30.0, seen))
    seen[0] = model = _net()
    plan = _plan(model, cache).plan
    assert plan.verification.kept == "planned"
    assert "verification kept" not in plan.table() and "optimiser" not in plan.table()
    assert any(len(pp.choice.steps) > 1 for _, _, pp in plan.pass_plans())
    assert all(pp.optimizer_choice is None for _, _, pp in plan.pass_plans())
    # within 1% of the fastest, the simpler variant wins
    monkeypatch.setattr(verify_mod, "wall_clock_ms", _steps_timer(10.0, 10.05, 30.0, seen))
    seen[0] = model = _net()
    assert _plan(model, cache).plan.verification.kept == "undivided"


def test_default_is_raced_only_when_the_budget_admits_it(tmp_path, monkeypatch):
    cache = _cache_favouring_division(tmp_path)
    seen = [None]
    # the default would be fastest, but a budget too small for it must keep it out of the race
    monkeypatch.setattr(verify_mod, "wall_clock_ms", _steps_timer(20.0, 30.0, 1.0, seen))
    probe = _plan(_net(), cache, verify=False).plan
    need = max(pp.default_workspace_bytes for _, _, pp in probe.pass_plans())
    smallest = max(pp.workspace_bytes for _, _, pp in probe.pass_plans())
    assert smallest < need, "test setup: the divided plan must need less than the default"
    limit = need - 1
    seen[0] = model = _net()
    planned = _plan(model, cache, limit)
    v = planned.plan.verification
    assert "default" not in v.times_ms and "over the budget" in v.excluded["default"]
    assert all(variant != "default" for variant, _ in seen[1:])
    assert v.kept in ("planned", "undivided")
    with WorkspaceAudit() as audit:
        planned(_x().requires_grad_()).sum().backward()
    assert audit.peak_bytes and max(audit.peak_bytes.values()) <= limit
    # with room for it, the default is raced and (fastest here) kept
    seen[0] = model = _net()
    planned = _plan(model, cache, need)
    assert planned.plan.verification.kept == "default"
    assert all(pp.steps() == [("default", BATCH)] for _, _, pp in planned.plan.pass_plans())


def test_verification_leaves_buffers_grads_flags_and_rng_alone(tmp_path):
    model = _net().train()  # BatchNorm and Dropout in training mode
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    planned = _plan(model, tmp_path / "c.sqlite")
    assert planned.plan.verification is not None and planned.plan.verification.mode == "training"
    assert torch.equal(torch.rand(3), expected), "planning or verification drew random numbers"
    after = planned.state_dict()
    for k in before:  # running statistics and num_batches_tracked untouched
        assert torch.equal(before[k], after[k]), k
    assert all(m.training for m in planned.modules())
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in planned.parameters())


def test_inference_plan_is_verified_forward_only(tmp_path, monkeypatch):
    calls = []

    def timer(variant, fn):
        calls.append(torch.is_grad_enabled())
        with torch.autograd.set_grad_enabled(True):  # fn must switch grad off itself
            fn()
        return 1.0
    monkeypatch.setattr(verify_mod, "wall_clock_ms", timer)
    plan = _plan(_net(), tmp_path / "c.sqlite", passes="inference").plan
    assert plan.verification.mode == "inference" and calls


def test_verify_off_keeps_the_optimiser_choice(tmp_path, monkeypatch):
    def boom(variant, fn):
        raise AssertionError("verification ran although verify=False")
    monkeypatch.setattr(verify_mod, "wall_clock_ms", boom)
    plan = _plan(_net(), tmp_path / "c.sqlite", verify=False).plan
    assert plan.verification is None and json.loads(plan.to_json())["verification"] is None


def test_identical_variants_are_timed_once():
    model = nn.Sequential(nn.Conv2d(2, 2, 3))
    x = torch.randn(4, 2, 6, 6)
    planned = PlannedConv2d(model[0], "0", find_convolutions(model, x)[0][0].geometry, {"forward": [("default", 4)]})
    model[0] = planned
    same = {"0": {"forward": [("im2col", 4)]}}
    variants = {"undivided": same, "planned": same}
    install = lambda v: setattr(planned, "steps", variants[v]["0"])  # noqa: E731
    timed = []
    v = verify_plan(model, x, install, variants, training=False, repeats=2,
                    timer=lambda name, fn: (timed.append(name), fn(), 5.0)[2])
    assert timed == ["undivided", "undivided"] and v.identical == {"planned": "undivided"}
    assert v.times_ms == {"undivided": 5.0, "planned": 5.0} and v.kept == "undivided"
    assert v.samples_ms == {"undivided": [5.0, 5.0]}  # the twin was not timed
    assert planned.steps == same["0"]
    with pytest.raises(ValueError, match="no variant"):
        verify_plan(model, x, install, {}, training=False)


@pytest.mark.parametrize("spread, kept", [(0.0, "planned"), (0.2, "undivided")])
def test_a_lead_within_the_noise_keeps_the_simpler_variant(spread, kept):
    # planned leads by 3% in the median; it is kept only if the rounds are steady enough to resolve that
    model = nn.Sequential(nn.Conv2d(2, 2, 3))
    x = torch.randn(4, 2, 6, 6)
    geom = find_convolutions(model, x)[0][0].geometry
    model[0] = planned = PlannedConv2d(model[0], "0", geom, {"forward": [("default", 4)]})
    variants = {"undivided": {"0": {"forward": [("im2col", 4)]}}, "planned": {"0": {"forward": [("im2col", 2)] * 2}}}
    install = lambda v: setattr(planned, "steps", variants[v]["0"])  # noqa: E731
    base = {"undivided": 100.0, "planned": 97.0}
    wobble = [0.0, 1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
    calls = {"undivided": 0, "planned": 0}

    def timer(name, fn):
        fn()
        i = calls[name]
        calls[name] += 1
        return base[name] * (1.0 + spread * wobble[i])

    v = verify_plan(model, x, install, variants, training=False, repeats=7, timer=timer)
    assert v.times_ms == base and v.kept == kept
    assert v.margins["planned"] >= 0.01 and (v.margins["planned"] > 0.03) == (kept == "undivided")
    assert planned.steps == variants[kept]["0"]


def test_an_input_that_requires_grad_is_differentiated_but_left_alone(tmp_path, monkeypatch):
    seen = []

    def timer(variant, fn):
        fn()
        seen.append(variant)
        return 1.0
    monkeypatch.setattr(verify_mod, "wall_clock_ms", timer)
    x = _x().requires_grad_()
    planned = microbatch(_net(), x, "64MiB", algorithms=FAST, repeats=1, progress=False,
                         cache=tmp_path / "c.sqlite", verify_repeats=2)
    assert seen and planned.plan.verification is not None
    assert x.grad is None  # the verification's backward went into its own leaf
