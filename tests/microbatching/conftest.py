import pytest


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    # never touch the user's real cache from tests
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(tmp_path / "cache"))
