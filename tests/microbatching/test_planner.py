"""The door: microbatch() plans, replaces Conv2d, keeps values/gradients, respects budgets, refuses bad ones."""

import copy
import json

import pytest
import torch
from torch import nn

from batchcraft.errors import ConfigurationError, WorkspaceError
from batchcraft.microbatching import MeasurementCache, PlannedConv2d, WorkspaceAudit, microbatch, parse_budget

FAST = ("default", "im2col", "fft", "onednn_channels_last")  # keep tests quick


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 4, 3, padding=1, padding_mode="reflect"),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _plan(model, x, limit="64MiB", **kw):
    kw.setdefault("algorithms", FAST)
    kw.setdefault("repeats", 1)
    kw.setdefault("progress", False)
    return microbatch(model, x, limit, **kw)


def _run(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("policy", ["wr", "wd"])
def test_planned_model_equals_original(policy, tmp_path):
    x = torch.randn(8, 3, 12, 12)
    ref = _net()
    planned = _plan(copy.deepcopy(ref), x, "200KiB", policy=policy, cache=tmp_path / "c.sqlite")
    assert sum(isinstance(m, PlannedConv2d) for m in planned.modules()) == 2
    assert "6" in planned.plan.skipped and "padding_mode" in planned.plan.skipped["6"]
    y0, dx0, g0 = _run(ref, x)
    y1, dx1, g1 = _run(planned, x)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-3, atol=1e-5)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-3, atol=1e-5, msg=k)


def test_planning_leaves_batchnorm_alone(tmp_path):
    model = _net().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planned = _plan(model, torch.randn(8, 3, 12, 12), cache=tmp_path / "c.sqlite")
    after = planned.state_dict()
    assert before.keys() == after.keys()
    for k in before:  # running_mean/var and num_batches_tracked untouched
        assert torch.equal(before[k], after[k]), k
    assert planned.training and all(m.training for m in planned.modules())
    assert sum(isinstance(m, nn.BatchNorm2d) for m in planned.modules()) == 2  # never split or replaced


@pytest.mark.parametrize("policy", ["wr", "wd"])
def test_measured_workspace_stays_within_budget(policy, tmp_path):
    x = torch.randn(16, 3, 16, 16)
    limit = "96KiB" if policy == "wr" else "256KiB"  # wd: the sum over 6 layer-passes must fit
    planned = _plan(_net(), x, limit, policy=policy, cache=tmp_path / "c.sqlite")
    budget = parse_budget(limit)
    plan = planned.plan
    assert plan.max_workspace_bytes <= budget
    if policy == "wd":
        assert plan.total_workspace_bytes <= budget
    with WorkspaceAudit() as audit:
        planned(x.requires_grad_()).sum().backward()
    assert audit.peak_bytes, "audit saw no planned layer"
    assert set(audit.peak_bytes) == {(n, p) for n, p, _ in plan.pass_plans()}
    for key, peak in audit.peak_bytes.items():
        assert peak <= budget, (key, peak)
    if policy == "wd":
        assert sum(audit.peak_bytes.values()) <= budget


def test_too_small_budget_names_layer_and_smallest_feasible(tmp_path):
    x = torch.randn(4, 3, 12, 12)
    cache = MeasurementCache(tmp_path / "c.sqlite")
    with pytest.raises(WorkspaceError) as exc:
        _plan(_net(), x, "1KiB", algorithms=("fft", "im2col"), cache=cache)
    msg = str(exc.value)
    assert "layer 0" in msg or "layer 3" in msg
    need = int(msg.split("smallest feasible budget for this model is ")[1].split(" bytes")[0])
    assert need > 1024
    planned = _plan(_net(), x, need, algorithms=("fft", "im2col"), cache=cache)  # exactly that budget works
    assert planned.plan.max_workspace_bytes <= need
    with pytest.raises(WorkspaceError, match="smallest feasible budget is"):
        _plan(_net(), x, need - 1, algorithms=("fft", "im2col"), policy="wd", cache=cache)


@pytest.mark.parametrize("bad", ["64XB", -1, "-1MiB"])
def test_malformed_budgets(bad, tmp_path):
    with pytest.raises(WorkspaceError, match="workspace_limit"):
        _plan(_net(), torch.randn(2, 3, 8, 8), bad, cache=tmp_path / "c.sqlite")


@pytest.mark.parametrize("kw, match", [
    (dict(policy="xx"), "policy"), (dict(batch_sizes="odd"), "batch_sizes"),
    (dict(passes="sideways"), "passes"), (dict(algorithms=("nope",)), "nope")])
def test_bad_options(kw, match, tmp_path):
    with pytest.raises(ConfigurationError, match=match):
        _plan(_net(), torch.randn(2, 3, 8, 8), cache=tmp_path / "c.sqlite", **kw)


def test_algorithms_that_cannot_run_a_layer(tmp_path):
    with pytest.raises(ConfigurationError, match="layer 3 .*none of the algorithms"):
        _plan(_net(), torch.randn(2, 3, 8, 8), algorithms=("fft",), cache=tmp_path / "c.sqlite")


def test_bad_example_input():
    with pytest.raises(ConfigurationError, match="4-D"):
        microbatch(_net(), torch.randn(3, 8, 8))


def test_cache_makes_second_planning_free(tmp_path):
    x = torch.randn(4, 3, 12, 12)
    # confirm/verify=False: the races are timed afresh each time, so choices could differ
    first = _plan(_net(), x, cache=tmp_path / "c.sqlite", confirm=False, verify=False).plan
    second = _plan(_net(), x, cache=tmp_path / "c.sqlite", confirm=False, verify=False).plan
    assert first.measured > 0 and second.measured == 0

    def choices(plan):  # the decisions; timings of an unchanged choice may be re-read differently
        return [(layer["name"], p, [(st["algorithm"], st["micro_batch"]) for st in v["steps"]])
                for layer in plan.to_dict()["layers"] for p, v in sorted(layer["passes"].items())]

    assert choices(second) == choices(first)


def test_inference_plan_refuses_backward(tmp_path):
    planned = _plan(_net(), torch.randn(4, 3, 12, 12), passes="inference", cache=tmp_path / "c.sqlite")
    assert all(set(layer.passes) == {"forward"} for layer in planned.plan.layers)
    y = planned(torch.randn(4, 3, 12, 12))
    with pytest.raises(WorkspaceError, match="not planned"):
        y.sum().backward()


def test_plan_table_and_json(tmp_path):
    plan = _plan(_net(), torch.randn(4, 3, 12, 12), cache=tmp_path / "c.sqlite").plan
    d = json.loads(plan.to_json())
    assert d["policy"] == "wr" and d["batch_size"] == 4 and d["workspace_limit_bytes"] == 64 * 2 ** 20
    assert [layer["name"] for layer in d["layers"]] == ["0", "3"]
    step = d["layers"][0]["passes"]["forward"]["steps"][0]
    assert {"algorithm", "micro_batch", "time_ms", "workspace_bytes"} <= set(step)
    assert sum(s["micro_batch"] for s in d["layers"][0]["passes"]["forward"]["steps"]) == 4
    text = plan.table()
    assert "backward_filter" in text and "vs_default" in text


def test_confirmation_keeps_a_raced_option(tmp_path):
    x = torch.randn(8, 3, 12, 12)
    cache = tmp_path / "c.sqlite"
    raw = _plan(_net(), x, cache=cache, confirm=False, verify=False).plan
    confirmed = _plan(_net(), x, cache=cache, verify=False).plan
    for (name, p, pp_raw), (_, _, pp) in zip(raw.pass_plans(), confirmed.pass_plans()):
        # the kept division is the DP's choice, the undivided best or the default, undivided
        assert pp.choice.steps == pp_raw.choice.steps or pp.choice.micro_batches == (8,), (name, p)
        assert pp.workspace_bytes <= confirmed.workspace_limit_bytes


def test_undivided_never_divides(tmp_path):
    plan = _plan(_net(), torch.randn(8, 3, 12, 12), batch_sizes="undivided", cache=tmp_path / "c.sqlite").plan
    assert all(pp.choice.micro_batches == (8,) for _, _, pp in plan.pass_plans())
    plan = _plan(_net(), torch.randn(8, 3, 12, 12), cache=tmp_path / "c.sqlite", confirm=False, verify=False).plan
    # unconfirmed, the DP's prediction is at least as fast as the undivided best (same measurements)
    assert all(pp.time_ms <= pp.undivided_ms + 1e-9 for _, _, pp in plan.pass_plans())
