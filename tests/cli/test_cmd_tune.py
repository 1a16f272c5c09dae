"""`batchcraft tune` end to end, for real: a registry model, a model in a file outside the
package, a whole program; JSON on stdout, the configuration and the result saved apart, and
`batchcraft launch` applying what was saved. Budgets and checks hold on a busy machine: nothing
asserts a speed, only what was measured and that the budget (with a margin for shutdown) held.
"""

import json
import os
import sys
import textwrap

import pytest
import torch

from batchcraft.cli import main
from batchcraft.parallel import ParallelConfig, usable_cpus

MODELS_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width=32):
            super().__init__()
            self.a, self.b = nn.Linear(12, width), nn.Linear(width, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    def build(width=32):
        return Net(width), torch.randn(2, 12)

    def only_model():
        return Net()
""")


@pytest.mark.slow
def test_tune_json_saves_the_configuration_and_the_result_apart_and_launch_applies_it(tmp_path, capsys):
    best, png = tmp_path / "best.json", tmp_path / "tune.png"
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    budget = 40.0  # 60% of it for start-up: enough on a busy machine
    rc = main(["tune", "--model", "mlp_fc512", "--batch-sizes", "2", "--budget", f"{budget:g}s", "--repeats", "1",
               "--final-repeats", "2", "--knobs", "matmul", "--max-trial-s", "0.05", "--json", "--output", str(best), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)  # exactly one JSON object on stdout
    assert torch.get_num_threads() == threads and os.environ.get("OMP_NUM_THREADS") == env  # restored
    (pb,) = result["per_batch"]
    assert pb["baselines"]  # which baselines fit depends on the machine's load; none is ever beaten
    assert all(r >= 1.0 for r in pb["ratios"].values()), pb["ratios"]
    assert set(pb["intervals"]) == set(pb["ratios"])
    assert result["elapsed_s"] <= budget + 2.0  # the budget holds (start-up included; shutdown margin)
    saved = json.loads(best.read_text())
    assert set(saved) == {"parallel_config", "tuned"} and len(best.read_text()) < 2000  # the configuration only
    full = json.loads((tmp_path / "best.result.json").read_text())
    assert full["trials"] and saved["tuned"]["result_file"] == str(tmp_path / "best.result.json")
    best_cfg = ParallelConfig.load(best)
    best_cfg.validate(usable_cpus(), oversubscribe=best_cfg.label != "grid")
    assert best_cfg.batch_size == 2 and saved["tuned"]["throughput_items_per_s"] > 0
    assert png.stat().st_size > 0
    if result["knobs"]:  # the knob race measured the other matmul backends against the choice
        assert {r["role"] for r in result["knobs"]["rows"]} >= {"choice"}

    script = tmp_path / "show.py"
    script.write_text("import json, os, sys, torch\n"
                      "open(sys.argv[1] + os.environ['BATCHCRAFT_INSTANCE'], 'w').write(json.dumps("
                      "[sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ['BATCHCRAFT_BATCH_SIZE'],"
                      " torch.nn.Linear.forward.__name__, os.environ['BATCHCRAFT_MATMUL']]))\n")
    rc = main(["launch", "--config", str(best), "--", sys.executable, str(script), str(tmp_path / "seen")])
    assert rc == 0
    cfg = saved["parallel_config"]
    for i in range(cfg["instances"]):
        affinity, threads, batch, forward, matmul = json.loads((tmp_path / f"seen{i}").read_text())
        if cfg["intra_op_threads"] is not None:
            assert threads == cfg["intra_op_threads"]
            if cfg["pin"]:
                block = ParallelConfig.load(best).cpus_for(i, usable_cpus())
                if "OMP_PROC_BIND" in (cfg.get("env") or {}) or "GOMP_CPU_AFFINITY" in (cfg.get("env") or {}):
                    # OpenMP binds the main thread inside the block when torch starts its threads
                    # (a tuned baseline may carry OMP_PROC_BIND=close): a subset, never outside
                    assert affinity and set(affinity) <= set(block), (affinity, block)
                else:
                    assert sorted(affinity) == sorted(block)
        assert batch == "2" and matmul == cfg["matmul"]
        assert forward == ("forward" if cfg["matmul"] == "default" else "linear_forward")


@pytest.mark.slow
def test_tune_a_model_defined_in_a_file_outside_the_package(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(MODELS_FILE)
    monkeypatch.chdir(tmp_path)  # importable from the working directory, as for a user
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["tune", "--model", "mymodels:build", "--model-kwargs", '{"width": 16}', "--batch-sizes", "4",
               "--budget", "30s", "--repeats", "1", "--final-repeats", "1", "--knobs", "none", "--max-trial-s",
               "0.05", "--json", "--output", str(tmp_path / "best.json")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert result["model"] == "mymodels:build" and result["analysis"]["heavy_ops"] == 2
    assert result["per_batch"][0]["best"]["throughput_items_per_s"] > 0
    # a factory that returns only the model: the input shape comes from --input-shape
    rc = main(["tune", "--model", "mymodels:only_model", "--input-shape", "12", "--batch-sizes", "1",
               "--budget", "30s", "--repeats", "1", "--final-repeats", "1", "--knobs", "none", "--max-trial-s",
               "0.05", "--json", "--output", str(tmp_path / "best2.json")])
    assert rc == 0 and json.loads(capsys.readouterr().out)["per_batch"]


SERVE = textwrap.dedent("""
    import os, sys, time
    import batchcraft.parallel as bp
    # a "server" whose speed does not depend on the machine's load: each batch takes 20 ms of sleep
    batch = int(os.environ.get("BATCHCRAFT_BATCH_SIZE", "1"))
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        time.sleep(0.02)
        bp.report(batch)
""")


@pytest.mark.slow
def test_tune_a_program_compares_configurations_by_the_items_it_reports(tmp_path, capsys):
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    rc = main(["tune", "--budget", "60s", "--repeats", "1", "--final-repeats", "1", "--knobs", "none",
               "--max-trial-s", "0.3", "--json",
               "--output", str(tmp_path / "best.json"), "--", sys.executable, str(script), "30"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    (pb,) = result["per_batch"]
    # every instance serves 50 items/s (20 ms per item): the tuner sees it and prefers more instances
    for r in [pb["best"], *pb["baselines"].values()]:
        per_instance = r["throughput_items_per_s"] / r["config"]["instances"]
        assert 25 < per_instance <= 51, r
    if len(usable_cpus()) >= 2:
        assert pb["best"]["config"]["instances"] >= 2
        assert min(pb["ratios"].values()) >= 1.5


def test_tune_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", "--model", "mlp_fc512", "--budget", "soon"])
    assert info.value.code == 2
    assert "expected a duration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--model", "mlp_fc512", "--knobs", "warp-drive"])
    assert "unknown knobs" in capsys.readouterr().err
    assert main(["tune"]) == 1
    assert "either --model NAME or -- COMMAND" in capsys.readouterr().err
    assert main(["tune", "--model", "mlp_fc512", "--", "python", "x.py"]) == 1
    assert main(["tune", "--model", "no_such_module_xyz:build", "--budget", "5s"]) == 1
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err
