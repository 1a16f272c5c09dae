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
