"""``batchcraft microbatch``: one JSON object on stdout, table otherwise, clear errors."""

import json

import pytest

from batchcraft.cli import main

ARGS = ["microbatch", "--model", "deepbench_3x3_224x224x3", "--batch-size", "2", "--image-size", "12",
        "--workspace", "1MiB", "--repeats", "2"]


@pytest.fixture(scope="module")
def _shared_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mbcache")  # one cache for the module: later tests reuse measurements


@pytest.fixture(autouse=True)
def _cache(_shared_cache_dir, monkeypatch):
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(_shared_cache_dir))


def test_json_output_is_one_object(capsys):
    assert main(ARGS + ["--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out)  # exactly one object, nothing else on stdout
    assert result["model"] == "deepbench_3x3_224x224x3" and result["batch_size"] == 2
    assert set(result["times_ms"]) >= {"default", "planned"}
    assert result["peak_workspace_bytes"]["planned"] <= result["workspace_limit_bytes"] == 2 ** 20
    assert result["plan"]["layers"][0]["name"] == "conv"
    v = result["verification"]  # the end-to-end race run while planning
    assert v == result["plan"]["verification"] and v["kept"] == result["kept"]
    assert v["kept"] in v["times_ms"] and v["mode"] == "training"
    assert set(v["times_ms"]) | set(v["excluded"]) == {"default", "undivided", "planned"}


def test_no_verify(capsys):
    assert main(ARGS + ["--json", "--inference", "--no-verify"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verification"] is None and result["kept"] is None


def test_table_output_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(ARGS + ["--inference", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "division" in out and "vs_default" in out and "peak workspace" in out
    assert "end-to-end verification while planning (inference" in out and "(kept)" in out
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("bad, code", [(["--workspace", "64XB"], "workspace"), (["--model", "nope"], "configuration"),
                                       (["--model", "mlp_fc512"], "configuration"),  # no Conv2d
                                       (["--model", "treelstm"], "configuration"),  # needs arguments
                                       (["--threads", "0"], "configuration")])
def test_errors_are_json_with_code(bad, code, capsys):
    argv = ARGS + bad + ["--json"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]["code"] == code
    assert "error" in captured.err


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()  # see tests/microbatching/conftest.py: 2 threads crawl on a busy machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_save_plan_then_load_it_without_measuring(capsys, tmp_path, monkeypatch):
    from batchcraft.microbatching.measure import Measurer

    path = tmp_path / "plan.json"
    assert main(ARGS + ["--json", "--save-plan", str(path)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["saved_plan"] == str(path) and json.loads(path.read_text())["format"] == "batchcraft-microbatch-plan"
    monkeypatch.setattr(Measurer, "measure", lambda *a, **k: pytest.fail("a loaded plan measured"))
    assert main(["microbatch", "--model", "deepbench_3x3_224x224x3", "--batch-size", "2", "--image-size", "12",
                 "--repeats", "2", "--load-plan", str(path), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["loaded_plan"] == str(path) and second["workspace_limit_bytes"] == 2 ** 20
    steps = lambda r: [(p, pp["steps"]) for layer in r["plan"]["layers"] for p, pp in layer["passes"].items()]  # noqa: E731
    assert steps(second) == steps(first)
    assert main(["microbatch", "--model", "deepbench_3x3_224x224x3", "--batch-size", "2", "--image-size", "12",
                 "--repeats", "2", "--load-plan", str(path)]) == 0
    assert f"plan re-applied from {path}" in capsys.readouterr().out


def test_a_plan_from_another_machine_is_refused_unless_remeasure(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(ARGS + ["--json", "--inference", "--no-verify", "--save-plan", str(path)]) == 0
    capsys.readouterr()
    d = json.loads(path.read_text())
    d["environment"]["threads"] = 64
    path.write_text(json.dumps(d))
    load = ["microbatch", "--model", "deepbench_3x3_224x224x3", "--batch-size", "2", "--image-size", "12",
            "--repeats", "2", "--no-verify", "--load-plan", str(path), "--json"]
    assert main(load) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "configuration" and "intra-op threads: 64 (plan)" in err["message"]
    assert "--remeasure" in err["hint"]
    assert main(load + ["--remeasure"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["measured_configurations"] > 0 and result["training"] is False


def test_when_verification_keeps_the_default_the_output_says_so(capsys, tmp_path, monkeypatch):
    from batchcraft.microbatching import verify as verify_mod

    monkeypatch.setattr(verify_mod, "disagreement", lambda *a, **k: None)
    monkeypatch.setattr(verify_mod, "wall_clock_ms", lambda variant, fn: (fn(), 1.0)[1])  # a tie: simplest kept
    png = tmp_path / "p.png"
    argv = ARGS[:-4] + ["--workspace", "64MiB", "--repeats", "2"]
    assert main(argv + (["--plot", str(png)] if _has_matplotlib() else [])) == 0
    out = capsys.readouterr().out
    assert "verification kept PyTorch's default convolution (no budget-driven algorithm, no micro-batching)" in out
    assert "kept 'default'" in out and "planned (runs default: kept by verification)" in out


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_float64_runs(capsys):
    assert main(ARGS + ["--json", "--inference", "--no-verify", "--dtype", "float64"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "float64" and result["plan"]["inputs"][0]["input"]["dtype"] == "float64"
    assert "nnpack forward" in result["plan"]["inputs"][0]["unsupported"]


def test_a_missing_plan_file_is_a_clear_error(tmp_path, capsys):
    # a raw FileNotFoundError traceback before (a new user's find, stop 47)
    assert main(ARGS + ["--load-plan", str(tmp_path / "none.json")]) == 1
    err = capsys.readouterr().err
    assert "none.json: cannot read file" in err and "Traceback" not in err
