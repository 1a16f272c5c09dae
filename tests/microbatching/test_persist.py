"""Plans saved and re-applied: identical plans and outputs, no measuring, refused from another environment."""

import json

import pytest
import torch
from torch import nn

from batchcraft.errors import ConfigurationError, DataFormatError
from batchcraft.microbatching import MeasurementCache, Plan, microbatch
from batchcraft.microbatching.measure import Measurer

ALGOS = ("default", "im2col", "unfold_matmul")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 6, 3, stride=2, padding=1, bias=False), nn.ReLU(), nn.Conv2d(6, 2, 1))


def _x(shape=(6, 3, 10, 10)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


def _planned(cache, **kw):
    kw = dict(dict(algorithms=ALGOS, repeats=1, progress=False, verify_repeats=2), **kw)
    return microbatch(_net(), _x(), "100KiB", cache=cache, **kw)


def _choices(plan):
    d = plan.to_dict()
    return [(i["input"]["shape"], layer["name"], p, [(s["algorithm"], s["micro_batch"]) for s in pp["steps"]])
            for i in d["inputs"] for layer in i["layers"] for p, pp in layer["passes"].items()]


def _no_measuring(monkeypatch):
    monkeypatch.setattr(Measurer, "measure", lambda *a, **k: pytest.fail("a re-applied plan measured"))
    monkeypatch.setattr(Measurer, "race", lambda *a, **k: pytest.fail("a re-applied plan raced"))


@pytest.mark.parametrize("policy", ["wr", "wd"])
def test_save_and_reload_give_identical_plans_and_outputs(tmp_path, monkeypatch, policy):
    model = _planned(MeasurementCache(tmp_path / "c.sqlite"), policy=policy)
    model(_x((3, 3, 14, 14)))  # a second input, planned on first sight: saved too
    path = model.plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.to_dict() == model.plan.to_dict()  # every field, verification included
    _no_measuring(monkeypatch)
    again = microbatch(_net(), _x(), plan=path, cache=False, progress=False)
    assert again.plan.to_dict() == model.plan.to_dict() and again.plan.source == f"plan file {path}"
    assert _choices(again.plan) == _choices(model.plan)
    again.load_state_dict(model.state_dict())  # BatchNorm statistics of model's train-mode call
    model.eval(), again.eval()
    with torch.no_grad():
        for shape in [(6, 3, 10, 10), (3, 3, 14, 14)]:
            assert torch.equal(again(_x(shape)), model(_x(shape)))  # same algorithms, same steps: same bits
    same = microbatch(_net(), _x(), plan=model.plan, cache=False, progress=False)  # a Plan object works too
    assert _choices(same.plan) == _choices(model.plan)


def test_reapplied_plan_still_plans_new_inputs(tmp_path):
    model = _planned(False, verify=False)
    path = model.plan.save(tmp_path / "p.json")
    again = microbatch(_net(), _x(), plan=path, cache=False, progress=False, verify=False)
    again(_x((2, 3, 8, 8)))
    assert [i.key.shape for i in again.plan.inputs] == [(6, 3, 10, 10), (2, 3, 8, 8)]
    assert again.plan.workspace_limit_bytes == 100 * 1024 and again.plan.inputs[1].measured > 0


@pytest.mark.parametrize("field, value", [("threads", 97), ("torch", "1.0.0"), ("device", "cpu:another CPU")])
def test_plan_from_another_environment_is_refused_or_remeasured(tmp_path, field, value):
    model = _planned(False, verify=False)
    d = model.plan.to_dict()
    d["environment"][field] = value
    path = tmp_path / "other.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigurationError) as exc:
        microbatch(_net(), _x(), plan=path, cache=False, progress=False)
    msg = str(exc.value)
    assert str(path) in msg and repr(value) in msg and "on_mismatch='remeasure'" in msg
    again = microbatch(_net(), _x(), plan=path, cache=False, progress=False, verify=False, on_mismatch="remeasure")
    assert again.plan.environment[field] != value and again.plan.measured > 0  # measured here, under its settings
    assert again.plan.workspace_limit_bytes == model.plan.workspace_limit_bytes


def test_malformed_plan_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "format": "batchcraft-microbatch-plan",\n  "version": 1,\n  oops\n}')
    with pytest.raises(DataFormatError) as exc:
        Plan.load(bad)
    assert exc.value.path == str(bad) and exc.value.line == 4
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(DataFormatError, match="not a batchcraft micro-batching plan"):
        microbatch(_net(), _x(), plan=other, cache=False)
    truncated = tmp_path / "t.json"
    truncated.write_text('{"format": "batchcraft-microbatch-plan", "version": 1, "policy": "wr"}')
    with pytest.raises(DataFormatError, match="malformed plan"):
        Plan.load(truncated)
    newer = tmp_path / "n.json"
    newer.write_text('{"format": "batchcraft-microbatch-plan", "version": 99}')
    with pytest.raises(DataFormatError, match="newer"):
        Plan.load(newer)


def test_a_plan_for_another_model_is_refused(tmp_path):
    path = _planned(False, verify=False).plan.save(tmp_path / "p.json")
    wider = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 6, 3, stride=2, padding=1, bias=False), nn.ReLU(), nn.Conv2d(6, 2, 1))
    with pytest.raises(ConfigurationError, match="layer '0' is .* in this model but"):
        microbatch(wider, _x(), plan=path, cache=False, progress=False)
    with pytest.raises(ConfigurationError, match="does not have as a Conv2d"):
        microbatch(nn.Sequential(nn.Identity(), nn.Conv2d(3, 2, 1)), _x(), plan=path, cache=False, progress=False)


def test_remeasure_ignores_the_cache(tmp_path):
    cache = MeasurementCache(tmp_path / "c.sqlite")
    first = _planned(cache, verify=False, confirm=False)
    assert first.plan.measured > 0
    assert _planned(cache, verify=False, confirm=False).plan.measured == 0  # all from the cache
    refreshed = _planned(cache, verify=False, confirm=False, remeasure=True)
    assert refreshed.plan.measured == first.plan.measured
    monkey = _planned("refresh", verify=False, confirm=False)  # the user's cache, refreshed
    assert monkey.plan.measured == first.plan.measured


def test_a_planned_model_pickles_and_copies(tmp_path):
    import copy
    import io

    model = _planned(MeasurementCache(tmp_path / "c.sqlite"), verify=False)
    buf = io.BytesIO()
    torch.save(model, buf)  # the whole module: session, plan, hooks; the cache reopens by path
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        model.eval(), other.eval()
        with torch.no_grad():
            assert torch.equal(other(_x()), model(_x()))
            other(_x((2, 3, 9, 9)))  # plans in the copy only
        assert len(other.plan.inputs) == 2 and len(model.plan.inputs) == 1
