import pytest
import torch


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    # never touch the user's real cache from tests
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _one_thread():
    # on a busy 2-core machine two OpenMP threads wait on each other at every barrier (an unfold of a
    # tiny batch took 52 ms with 2 threads, 0.9 ms with 1); no test here depends on the thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
