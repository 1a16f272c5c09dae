"""`batchcraft tune` and `batchcraft launch` end to end: JSON on stdout, saved best, applied config."""

import json
import os
import sys

import pytest
import torch

from batchcraft.cli import main
from batchcraft.parallel import BASELINES, ParallelConfig, usable_cpus


@pytest.mark.slow
def test_tune_json_saves_best_and_launch_applies_it(tmp_path, capsys):
    best, png = tmp_path / "best.json", tmp_path / "tune.png"
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    rc = main(["tune", "--model", "mlp_fc512", "--batch-sizes", "2", "--budget", "12s", "--repeats", "1",
               "--json", "--output", str(best), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)  # exactly one JSON object on stdout
    assert torch.get_num_threads() == threads and os.environ.get("OMP_NUM_THREADS") == env  # restored
    (pb,) = result["per_batch"]
    assert set(pb["ratios"]) == set(BASELINES)
    # the choice and every baseline were measured in the same final round; the choice is never worse
    assert all(r >= 1.0 for r in pb["ratios"].values()), pb["ratios"]
    assert {r["config"]["label"] for r in result["rounds"] if r["role"] == "final"} >= set(BASELINES)
    assert result["elapsed_s"] <= 12 + 1.0  # the budget holds (start-up included)
    best_cfg = ParallelConfig.load(best)
    best_cfg.validate(usable_cpus(), oversubscribe=best_cfg.label != "grid")
    saved = json.loads(best.read_text())
    assert saved["best"]["batch_size"] == 2 and saved["best"]["throughput_items_per_s"] > 0
    assert png.stat().st_size > 0

    script = tmp_path / "show.py"
    script.write_text("import json, os, sys, torch\n"
                      "open(sys.argv[1] + os.environ['BATCHCRAFT_INSTANCE'], 'w').write(json.dumps("
                      "[sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ['BATCHCRAFT_BATCH_SIZE']]))\n")
    rc = main(["launch", "--config", str(best), "--", sys.executable, str(script), str(tmp_path / "seen")])
    assert rc == 0
    cfg = saved["best"]
    for i in range(cfg["instances"]):
        affinity, threads, batch = json.loads((tmp_path / f"seen{i}").read_text())
        if cfg["intra_op_threads"] is not None:
            assert threads == cfg["intra_op_threads"]
            if cfg["pin"]:
                assert len(affinity) == len(usable_cpus()) // cfg["instances"]
        assert batch == "2"


def test_tune_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", "--model", "mlp_fc512", "--budget", "soon"])
    assert info.value.code == 2
    assert "expected a duration" in capsys.readouterr().err
