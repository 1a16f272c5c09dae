"""`batchcraft bench`: front of benchmarks/vs_dynet.py (the checkout's side-by-side benchmark)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from batchcraft.cli import main


def test_bench_outside_a_checkout_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--checkout", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "[configuration]" in err and "vs_dynet.py not found" in err and "checkout" in err


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--sentences", "0"], ["--warmup", "-1"]])
def test_bench_rejects_bad_numbers(bad, capsys):
    assert main(["bench", *bad, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"]["code"] == "configuration" and bad[0] in out["error"]["message"]


def test_bench_unknown_model_is_rejected(capfd):
    assert main(["bench", "--models", "nosuchmodel", "--systems", "eager"]) == 1
    assert "unknown model" in capfd.readouterr().err


@pytest.mark.slow
def test_bench_small_run_json(capfd):
    rc = main(["bench", "--models", "treelstm", "--hidden", "8", "--batch-sizes", "4", "--sentences", "8",
               "--repeats", "1", "--warmup", "0", "--systems", "dynet,eager,handbatched,batchcraft", "--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    by = {r["system"]: r for r in res["results"]}
    assert not [r for r in res["results"] if "error" in r]
    for s in ("eager", "handbatched", "batchcraft-depth", "batchcraft-agenda"):
        assert by[s]["inference_ms"] > 0 and by[s]["train_ms"] > 0 and by[s]["rss_peak_train_bytes"] > 0
        assert by[s]["out_max_abs_diff"] <= 1e-5 and by[s]["grad_max_abs_diff"] <= 1e-4
    if importlib.util.find_spec("dynet") is None:  # optional: the benchmark says so and runs the rest
        assert any("DyNet is not installed" in n for n in res["notes"])
        assert not any(s.startswith("dynet-") for s in by)
    else:
        for mode in range(4):
            assert by[f"dynet-{mode}"]["out_max_abs_diff"] <= 1e-5
    (row_inf, row_train) = sorted(res["rows"], key=lambda r: r["mode"])
    assert row_inf["mode"] == "inference" and 0 < row_inf["flop_bound_ms"] < row_train["flop_bound_ms"]
    assert row_inf["batchcraft_ms"] == min(by["batchcraft-depth"]["inference_ms"],
                                           by["batchcraft-agenda"]["inference_ms"])
