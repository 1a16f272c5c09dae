"""`batchcraft run`: the main job's table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from batchcraft.cli import main


def test_run_treelstm_json(capsys):
    rc = main(["run", "treelstm", "--limit", "24", "--batch-size", "8", "--hidden", "16", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("model", "batch_size", "eager_ms", "batchcraft_ms", "speedup", "max_abs_diff",
                "batched_calls", "ops_recorded"):
        assert key in res
    assert res["model"] == "treelstm" and res["batch_size"] == 8
    assert res["max_abs_diff"] <= 1e-5
    assert 0 < res["batched_calls"] < res["ops_recorded"]


def test_run_table_and_list(capsys):
    assert main(["run", "treelstm", "--limit", "16", "--batch-size", "8", "--hidden", "16",
                 "--no-progress", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "batchcraft.autobatch" in out and "time split" in out
    assert "more auto-batched passes run back to back" in out and "the timed pass" in out
    assert main(["run", "--list"]) == 0
    assert "treelstm" in capsys.readouterr().out


def test_run_errors(capsys, tmp_path):
    assert main(["run", "nosuchmodel"]) == 1
    assert "unknown model" in capsys.readouterr().err
    bad = tmp_path / "bad.conllu"
    bad.write_text("1\tA\n\n")
    assert main(["run", "treelstm", "--data", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"]["code"] == "data-format" and "bad.conllu:1" in out["error"]["message"]
    assert main(["run", "treelstm", "--batch-size", "0"]) == 1
    assert main(["run", "treelstm", "--threads", "0"]) == 1
    assert "--threads must be >= 1" in capsys.readouterr().err
    empty = tmp_path / "empty.conllu"
    empty.write_text("# a comment and no sentence\n")
    assert main(["run", "treelstm", "--data", str(empty)]) == 1
    err = capsys.readouterr().err
    assert "empty.conllu" in err and "no sentences" in err


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "batchcraft", "run", "--list"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "treelstm" in r.stdout


def test_run_reports_fusion_and_a_busy_machine(capsys, monkeypatch):
    from batchcraft.cli import cmd_run

    monkeypatch.setattr(cmd_run, "_busy_cpus", lambda: 1.0)  # a fake load: no test depends on the real one
    assert main(["run", "treelstm", "--limit", "16", "--batch-size", "8", "--hidden", "16",
                 "--no-progress", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "fused kernels per batch" in out and "other processes kept 1.0 of" in out
    monkeypatch.setattr(cmd_run, "_busy_cpus", lambda: 0.0)
    assert main(["run", "treelstm", "--limit", "16", "--batch-size", "8", "--hidden", "16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["busy_cpus_before"] == 0.0 and res["steps_fused"] >= 0 and "fused_kernels" in res


def test_busy_cpus_reads_a_fraction_of_the_machine():
    from batchcraft.cli import cmd_run

    import os

    assert 0.0 <= cmd_run._busy_cpus(0.05) <= (os.cpu_count() or 1) + 1e-9


def test_more_threads_than_cores_are_run_with_a_note(capsys):
    # a new user's find (stop 47): --threads 99 on 2 cores ran without a word
    import torch

    from batchcraft.parallel.config import usable_cpus

    before = torch.get_num_threads()
    try:
        n = len(usable_cpus()) + 1
        assert main(["run", "treelstm", "--limit", "4", "--batch-size", "4", "--hidden", "8", "--threads", str(n),
                     "--json"]) == 0
    finally:
        torch.set_num_threads(before)
    captured = capsys.readouterr()
    assert f"--threads {n} on {n - 1} usable core" in captured.err
    json.loads(captured.out)  # the JSON on stdout stays one object
