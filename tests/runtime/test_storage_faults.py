"""Full and failing disks, on real small file systems this test mounts (tmpfs with a size
limit; root only) under a real in-process cluster: inserts past a full or read-only data
directory are refused with a ``StorageError`` and nothing acknowledged is lost or half
written; once there is room again writes resume without a restart. A worker whose spill
folder fills up fails the query, not itself."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from shardflow.catalog.store import IGNORE_FULL_VARIABLE
from shardflow.errors import QueryError, StorageError
from tests.support.disks import small_tmpfs
from tests.support.local_cluster import LocalCluster, events

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB, unmounted after the test."""
    with small_tmpfs(tmp_path / "disk", "8m") as mount:
        yield mount


def _fill(cluster: LocalCluster, start: int) -> tuple[int, StorageError]:
    """Insert batches until the storage refuses one; the first id not acknowledged (the
    refused batch is ``batch-<that id>``)."""
    for _ in range(1000):
        try:
            cluster.insert("events", events(start, 2000), f"batch-{start}")
        except StorageError as error:
            return start, error
        start += 2000
    raise AssertionError("the disk never filled up")


def _assert_holds(cluster: LocalCluster, rows: int, refused: int = 0) -> None:
    """The cluster serves ids 0..rows-1 once each, and of the refused batch of ``refused``
    rows after them at most those of the shards that had room (each once)."""
    answer = cluster.sql(
        f"SELECT count(*) FILTER (WHERE id < {rows}) AS n, "
        f"sum(id) FILTER (WHERE id < {rows}) AS s, count(DISTINCT id) AS d, "
        f"count(*) FILTER (WHERE id >= {rows + refused}) AS beyond, "
        f"count(*) - count(DISTINCT id) AS twice FROM events"
    ).to_pylist()[0]
    assert answer["n"] == rows and answer["s"] == rows * (rows - 1) // 2, answer
    assert answer["d"] - rows <= refused and answer["beyond"] == answer["twice"] == 0, answer


def _partial_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def test_inserts_past_a_full_disk_are_refused_and_resume_when_space_returns(
    small_disk: Path,
) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (2 << 20))  # what the operator frees later
    cluster = LocalCluster(small_disk / "data", nodes=2)
    try:
        cluster.create_table("events", events(0, 1000), "id")
        acked, error = _fill(cluster, 1000)
        assert "is full" in str(error) and "nothing of this write was kept" in str(error)
        # every acknowledged row; of the refused batch at most the parts of shards with room
        _assert_holds(cluster, acked, refused=2000)
        assert _partial_files(small_disk) == []
        with pytest.raises(StorageError):  # still full: refused again, still nothing kept
            cluster.insert("events", events(acked, 2000), f"batch-{acked}")
        _assert_holds(cluster, acked, refused=2000)
        filler.unlink()  # room again: the same batch, tried again, lands whole and once
        cluster.insert("events", events(acked, 2000), f"batch-{acked}")
        _assert_holds(cluster, acked + 2000)
    finally:
        cluster.close()


def test_the_full_disk_test_fails_where_a_refused_write_passes_for_done(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off (``SHARDFLOW_TEST_IGNORE_FULL_DISK``): inserts past full
    are acknowledged, and the test above finds it."""
    monkeypatch.setenv(IGNORE_FULL_VARIABLE, "1")
    with pytest.raises(AssertionError, match="never filled up"):
        test_inserts_past_a_full_disk_are_refused_and_resume_when_space_returns(small_disk)


def test_a_read_only_data_directory_refuses_writes_and_takes_them_again(
    small_disk: Path,
) -> None:
    cluster = LocalCluster(small_disk / "data", nodes=2)
    try:
        cluster.create_table("events", events(0, 1000), "id")
        cluster.insert("events", events(1000, 1000))
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        try:
            with pytest.raises(StorageError, match="read-only"):
                cluster.insert("events", events(2000, 1000))
            _assert_holds(cluster, 2000)  # reads go on
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
        cluster.insert("events", events(2000, 1000))
        _assert_holds(cluster, 3000)
    finally:
        cluster.close()


def test_a_full_spill_folder_fails_the_query_not_the_worker(
    small_disk: Path, tmp_path: Path
) -> None:
    cluster = LocalCluster(
        tmp_path / "data", nodes=1, worker_memory_mb=24, local_dir=str(small_disk),
        retry_deadline_s=10,
    )  # fmt: skip
    try:
        rows = 400_000
        ids = pa.array(range(rows), pa.int64())
        words = pa.array([f"{i:x}" * 8 for i in range(rows)])
        cluster.create_table("t", pa.table({"id": ids, "s": words}), "id")
        spilling = "SELECT count(*) FROM (SELECT DISTINCT s || id::VARCHAR || s AS w FROM t)"
        with pytest.raises(QueryError, match="node-0"):
            cluster.sql(spilling)
        load = cluster.session.node_loads()["node-0"]  # not counted against the node
        assert load.health == "healthy" and load.failure_rate == 0.0
        assert cluster.sql("SELECT count(*) AS n FROM t").to_pylist() == [{"n": rows}]
    finally:
        cluster.close()
