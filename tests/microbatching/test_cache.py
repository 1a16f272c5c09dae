"""SQLite measurement cache: round trip, keys, corrupt files, concurrent processes."""

import multiprocessing as mp
import sqlite3
import warnings

import pytest

from batchcraft.microbatching.cache import (SCHEMA_VERSION, MeasurementCache, MeasurementKey, MeasurementRecord,
                                            default_cache_path)


def _key(**over):
    base = dict(device="cpu:test", torch_version="2.x", threads=2, dtype="float32", geometry="g1",
                pass_="forward", algorithm="fft", micro_batch=8, divided=True)
    base.update(over)
    return MeasurementKey(**base)


def test_round_trip_and_every_key_field_matters(tmp_path):
    path = tmp_path / "c.sqlite"
    with MeasurementCache(path) as c:
        c.put(_key(), MeasurementRecord(1.5, 3, 1000))
        assert c.get(_key()) == MeasurementRecord(1.5, 3, 1000)
        for field, other in [("device", "cpu:other"), ("torch_version", "3"), ("threads", 1), ("dtype", "float64"),
                             ("geometry", "g2"), ("pass_", "backward_data"), ("algorithm", "im2col"),
                             ("micro_batch", 4), ("divided", False)]:
            assert c.get(_key(**{field: other})) is None, field
        c.put(_key(), MeasurementRecord(None, 0, 5))  # replace: memory-only record
        assert c.get(_key()) == MeasurementRecord(None, 0, 5)
    with MeasurementCache(path) as c:  # persisted
        assert c.get(_key()).workspace_bytes == 5 and len(c) == 1


def test_file_is_wal_with_versioned_table(tmp_path):
    path = tmp_path / "c.sqlite"
    MeasurementCache(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert f"measurements_v{SCHEMA_VERSION}" in tables


def test_default_path_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHCRAFT_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_path() == tmp_path / "x" / "microbatch.sqlite"
    c = MeasurementCache()
    assert c.path.exists()
    c.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_file_is_moved_aside_and_rebuilt(tmp_path, damage):
    path = tmp_path / "c.sqlite"
    with MeasurementCache(path) as c:
        for i in range(200):
            c.put(_key(micro_batch=i), MeasurementRecord(1.0, 1, i))
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"this is not a database" * 100)
    else:  # header intact, pages cut: quick_check must notice
        path.write_bytes(data[: len(data) // 2] + b"\x00" * 100)
    with pytest.warns(RuntimeWarning, match="moved to"):
        c = MeasurementCache(path)
    assert c.recovered_from is not None and c.recovered_from.exists()
    assert len(c) == 0  # rebuilt empty, usable
    c.put(_key(), MeasurementRecord(2.0, 1, 7))
    assert c.get(_key()).time_ms == 2.0
    c.close()


def _writer(path, worker, count):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = MeasurementCache(path)
    for i in range(count):
        c.put(_key(algorithm=f"w{worker}", micro_batch=i), MeasurementRecord(float(i), 1, i))
        c.get(_key(algorithm=f"w{1 - worker}", micro_batch=i))
    c.close()


def test_two_processes_write_at_once(tmp_path):
    path = tmp_path / "shared.sqlite"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 150)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with MeasurementCache(path) as c:
        assert len(c) == 300
        assert c.get(_key(algorithm="w1", micro_batch=149)).workspace_bytes == 149


def test_unwritable_directory_is_a_clear_error(tmp_path):
    from batchcraft.errors import MeasurementCacheError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MeasurementCacheError, match="cannot create"):
        MeasurementCache(blocker / "sub" / "c.sqlite")
