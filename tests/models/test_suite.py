"""The ACRoBat suite registry and `batchcraft run MODEL` for every suite model (issue 3)."""

from __future__ import annotations

import json

import pytest
import torch

from batchcraft import models
from batchcraft.cli import main
from batchcraft.data import load_sentences
from batchcraft.models import suite

SUITE = ["treelstm", "mvrnn", "birnn", "nestedrnn", "drnn", "berxit", "stackrnn"]


def test_every_suite_model_is_registered_with_its_sizes():
    assert set(SUITE) <= set(suite.BUILDERS)
    assert set(SUITE) <= set(models.names())
    sents = load_sentences(limit=4)
    for name in SUITE:
        for size in ("small", "large"):
            if name in ("berxit", "nestedrnn") and size == "large":
                continue  # same code path as small; building them at 512 only costs time
            task = suite.build(name, sents, size=size)
            expected = {"small": 64, "large": 128}[size] if name == "mvrnn" else suite.SIZES[size]
            assert task.hidden == expected and task.name == name
            assert len(task.instances) == 4 and task.description
    with pytest.raises(ValueError, match="size"):
        suite.build("mvrnn", sents, size="huge")


@pytest.mark.parametrize("name", SUITE[1:])
def test_run_json_for_each_model(name, capsys):
    rc = main(["run", name, "--limit", "4", "--batch-size", "2", "--hidden", "8", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["model"] == name and res["hidden"] == 8 and res["instances"] == 4
    assert res["max_abs_diff"] <= 1e-5
    assert 0 < res["batched_calls"] <= res["ops_recorded"] and res["fallbacks"] == 0


def test_run_list_names_every_model(capsys):
    assert main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUITE)


def test_models_get_builds_each_suite_model():
    torch.manual_seed(0)
    assert models.get("mvrnn", vocab_size=10, hidden=4)(_one_word()).shape == (4,)
    assert models.get("stackrnn", vocab_size=10, hidden=4)(_one_word())["heads"] == [-1]


def _one_word():
    from equivalence import make_tree

    return make_tree([-1], vocab_size=10)
