"""Policy registry: WR and WD answer the same questions (network workspace, admits, optimise, explain)."""

import pytest

from batchcraft.errors import ConfigurationError, WorkspaceError
from batchcraft.microbatching.policies import POLICIES, Policy, get_policy
from batchcraft.microbatching.types import Config


def _tables():
    # two layer-passes, B = 4: "fast" needs 10 bytes per sample, "slow" none
    t = {}
    for key in [("conv1", "forward"), ("conv2", "forward")]:
        t[key] = {4: [Config("slow", 4, 40.0, 0), Config("fast", 4, 8.0, 40)],
                  2: [Config("fast", 2, 5.0, 20)], 1: [Config("fast", 1, 3.0, 10)]}
    return t


def test_registry_and_lookup():
    assert set(POLICIES) == {"wr", "wd"} and all(isinstance(p, Policy) for p in POLICIES.values())
    assert get_policy("wd") is POLICIES["wd"] and get_policy(POLICIES["wr"]) is POLICIES["wr"]
    with pytest.raises(ConfigurationError, match="'wr', 'wd'"):
        get_policy("xx")


def test_network_workspace_and_admits():
    wr, wd = POLICIES["wr"], POLICIES["wd"]
    assert wr.network_workspace([10, 30, 20]) == 30 and wd.network_workspace([10, 30, 20]) == 60
    assert wr.admits([10, 30], 30) and not wd.admits([10, 30], 30) and wd.admits([10, 30], 40)
    assert not wr.admits([10, None], 10 ** 9)  # unknown workspace never fits
    assert wr.per_layer_limit and not wd.per_layer_limit


def test_optimise_and_undivided_under_each_policy():
    wr, wd = POLICIES["wr"], POLICIES["wd"]
    # WR, 20 bytes each: fast@2 twice per layer (10 ms each layer)
    choice = wr.optimise(_tables(), 4, 20)
    assert {k: c.micro_batches for k, c in choice.items()} == {k: (2, 2) for k in _tables()}
    # WD, 30 bytes for both: one layer gets fast@2 (20 bytes), the other fast@1 (10 bytes): 10 + 12 ms
    choice = wd.optimise(_tables(), 4, 30)
    assert sum(c.workspace_bytes for c in choice.values()) <= 30
    assert sum(c.time_ms for c in choice.values()) == pytest.approx(22.0)
    assert wd.optimise(_tables(), 4, -1) is None
    und = wr.undivided(_tables(), 4, 20)
    assert all(c.micro_batches == (4,) and c.steps[0].algorithm == "slow" for c in und.values())
    und = wd.undivided(_tables(), 4, 40)  # only one layer can afford fast@4
    assert sorted(c.steps[0].algorithm for c in und.values()) == ["fast", "slow"]


def test_explain_infeasible_names_layer_and_smallest_budget():
    minimum = {("conv1", "forward", None): 100, ("conv2", "backward_data", None): 300}
    wr = POLICIES["wr"].explain_infeasible(minimum, 50, "powerOfTwo")
    assert isinstance(wr, WorkspaceError)
    assert "layer conv2 (backward_data)" in str(wr) and "smallest feasible budget for this model is 300 bytes" in str(wr)
    wd = POLICIES["wd"].explain_infeasible(minimum, 50, "powerOfTwo")
    assert "add up to 400 bytes" in str(wd) and "largest share is layer conv2" in str(wd)
