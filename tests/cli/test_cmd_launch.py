"""`batchcraft launch`: configuration and command errors (applying a config: see test_cmd_tune)."""

import json
import sys

from batchcraft.cli import main


def test_launch_errors_are_reported_as_json_free_messages(tmp_path, capsys):
    assert main(["launch", "--config", str(tmp_path / "missing.json"), "--", "true"]) == 1
    assert "no such file" in capsys.readouterr().err
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"parallel_config": {"instances": 1, "intra_op_threads": 1}}))
    assert main(["launch", "--config", str(cfg), "--", sys.executable, str(tmp_path / "nope.py")]) == 1
    assert "no such script" in capsys.readouterr().err
