"""Allocator and OpenMP wait policy: where libraries are found, what the environment gets."""

import pytest

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import env_knobs


@pytest.fixture
def fresh_lookup():
    env_knobs.find_allocator.cache_clear()
    yield
    env_knobs.find_allocator.cache_clear()


def test_an_allocator_is_found_where_run_cpu_looks(tmp_path, monkeypatch, fresh_lookup):
    lib = tmp_path / "lib" / "libtcmalloc.so.4"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path))
    monkeypatch.setattr(env_knobs.ctypes.util, "find_library", lambda name: None)
    assert env_knobs.find_allocator("tcmalloc") == str(lib)
    env = env_knobs.knob_env("tcmalloc", base_env={"LD_PRELOAD": "/other.so"})
    assert env["LD_PRELOAD"] == f"{lib}:/other.so" and "MALLOC_CONF" not in env


def test_a_missing_allocator_says_what_to_install(monkeypatch, fresh_lookup):
    monkeypatch.setattr(env_knobs, "_search_dirs", lambda: [])
    monkeypatch.setattr(env_knobs.ctypes.util, "find_library", lambda name: None)
    assert env_knobs.available_allocators() == ("default",)
    with pytest.raises(ConfigurationError, match="not installed") as info:
        env_knobs.knob_env("jemalloc")
    assert "libjemalloc2" in info.value.hint


def test_jemalloc_gets_run_cpus_settings(fresh_lookup):
    if not env_knobs.find_allocator("jemalloc"):
        pytest.skip("jemalloc not installed here")
    env = env_knobs.knob_env("jemalloc", base_env={})
    assert "jemalloc" in env["LD_PRELOAD"] and env["MALLOC_CONF"] == env_knobs.JEMALLOC_CONF


@pytest.mark.parametrize("policy,expect", [("default", {}), ("passive", {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}),
                                           ("active", {"OMP_WAIT_POLICY": "ACTIVE", "KMP_BLOCKTIME": "infinite"})])
def test_wait_policies(policy, expect):
    assert env_knobs.knob_env(omp_wait_policy=policy) == expect


def test_unknown_values():
    with pytest.raises(ConfigurationError, match="omp_wait_policy must be one of"):
        env_knobs.knob_env(omp_wait_policy="sometimes")
    with pytest.raises(ConfigurationError, match="allocator must be one of"):
        env_knobs.find_allocator("hoard")
