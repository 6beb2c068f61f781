"""Durability of one shard: log, base, checkpoint, recovery and idempotent retries.
Real files in a temporary directory; a crash is simulated by dropping the in-memory shard
and rebuilding it from disk."""

import os
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardflow.catalog import DataDir
from shardflow.catalog import store as store_module
from shardflow.engine import DuckDBEngine
from shardflow.engine.duckdb_engine import NativeRows
from shardflow.errors import Moved
from shardflow.storage import CheckpointPolicy, Shard, ShardStore
from shardflow.storage.shard import STAGE_ROWS
from shardflow.storage.shard_store import BaseWriter, read_checkpoint

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


def rows(start: int, count: int) -> pa.Table:
    ids = list(range(start, start + count))
    return pa.table({"id": ids, "name": [f"r{i}" for i in ids]}, schema=SCHEMA)


def shard_at(path: Path, policy: CheckpointPolicy | None = None) -> Shard:
    store = ShardStore(DataDir.resolve(str(path)), "table-uid", "0")
    return Shard(store, SCHEMA, policy=policy)


def reopened(path: Path) -> Shard:
    shard = shard_at(path)
    shard.recover()
    return shard


def read_base(path: Path) -> pa.Table:
    """A shard's base file, as Arrow (a Parquet base, or a checkpoint file)."""
    return read_checkpoint(str(path)) if path.suffix == ".duckdb" else pq.read_table(path)


def ids(shard: Shard) -> list[int]:
    return sorted(shard.snapshot().column("id").to_pylist())


def test_load_then_inserts_survive_a_crash(tmp_path: Path) -> None:
    shard = shard_at(tmp_path)
    shard.stage(rows(0, 5))
    shard.stage(rows(5, 5))
    assert shard.commit_load() == 10
    assert shard.append(rows(100, 3), "batch-a").lsn == 1
    assert shard.append(rows(200, 2), "batch-b").lsn == 2
    recovered = reopened(tmp_path)
    assert ids(recovered) == [*range(10), 100, 101, 102, 200, 201]
    assert recovered.lsn == 2


def test_staged_rows_reach_the_row_store_a_row_group_at_a_time(tmp_path: Path) -> None:
    """A split stages the halves of each chunk; DuckDB copies an INSERT of less than a row
    group once more at its commit, so small parts are handed over together, in whole row
    groups (a part-full row group in the middle of the file is merged, rewritten whole, at
    the first checkpoint after rows are deleted from it); the rest at the commit."""
    engine = DuckDBEngine(threads=1, file_folders=[str(tmp_path)])
    try:
        native = engine.native_rows("staged", SCHEMA)
        store = ShardStore(DataDir.resolve(str(tmp_path)), "table-uid", "0")
        shard = Shard(store, SCHEMA, rows=native)
        handed: list[int] = []
        stage = native.stage
        native.stage = lambda table: (handed.append(table.num_rows), stage(table))[-1]  # type: ignore[method-assign]
        part = STAGE_ROWS // 3 + 1
        for start in range(0, 7 * part, part):
            shard.stage(rows(start, part))
        assert handed == [STAGE_ROWS, STAGE_ROWS]  # the rest waits for more, or the commit
        assert shard.commit_load() == 7 * part
        assert handed == [STAGE_ROWS, STAGE_ROWS, 7 * part - 2 * STAGE_ROWS]
        assert ids(shard) == list(range(7 * part))
        assert native._base is not None
        with duckdb.connect() as con:  # the file's row groups: whole, but for the last
            con.execute(f"ATTACH '{native._base.path}' AS f (READ_ONLY)")
            groups = con.execute(
                "SELECT row_group_id, sum(count) FROM pragma_storage_info('f.main.rows') "
                "WHERE column_id = 0 AND segment_type <> 'VALIDITY' GROUP BY 1 ORDER BY 1"
            ).fetchall()
        assert [n for _, n in groups] == [STAGE_ROWS, STAGE_ROWS, 7 * part - 2 * STAGE_ROWS]
        shard.stage(rows(0, 10))
        shard.abandon_load()  # the rows still waiting go with the load
        assert handed == [STAGE_ROWS, STAGE_ROWS, 7 * part - 2 * STAGE_ROWS]
        assert ids(shard) == list(range(7 * part))
    finally:
        engine.close()


def test_a_retried_batch_is_applied_once_even_after_recovery(tmp_path: Path) -> None:
    shard = shard_at(tmp_path)
    shard.commit_load()
    first = shard.append(rows(0, 4), "same")
    again = shard.append(rows(0, 4), "same")
    assert not first.duplicate and again.duplicate and shard.rows == 4
    recovered = reopened(tmp_path)
    assert recovered.append(rows(0, 4), "same").duplicate
    assert recovered.rows == 4


def test_checkpoint_folds_the_log_into_the_base(tmp_path: Path) -> None:
    shard = shard_at(tmp_path, CheckpointPolicy(max_wal_entries=3))
    shard.commit_load()
    for i in range(7):
        shard.append(rows(i * 10, 2), f"b{i}")
        shard.wait_for_checkpoint()  # written in the background
    names = sorted(p.name for p in shard_folder_files(tmp_path))
    assert sum(n.startswith("base-") for n in names) == 1
    assert sum(n.startswith("wal-") for n in names) == 1  # 7 entries, checkpoint every 3
    recovered = reopened(tmp_path)
    assert recovered.rows == 14 and recovered.lsn == 7
    # batch ids survive checkpoints, so retries of old batches stay idempotent
    assert recovered.append(rows(0, 2), "b0").duplicate


@pytest.mark.parametrize("native", [False, True], ids=["arrow", "duckdb"])
def test_appends_go_on_while_a_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A checkpoint reads and writes the whole shard: it runs beside the appends, not in
    front of them (held here until three more appends are done), and writes exactly the
    rows of its LSN (a DuckDB shard's from a pinned snapshot, however many rows follow)."""
    engine = DuckDBEngine(threads=1, file_folders=[str(tmp_path)]) if native else None
    store = ShardStore(DataDir.resolve(str(tmp_path)), "table-uid", "0")
    data = NativeRows(engine, "t0", SCHEMA) if engine is not None else None
    shard = Shard(store, SCHEMA, rows=data, policy=CheckpointPolicy(max_wal_entries=3))
    shard.commit_load()
    gate = threading.Event()
    released: list[bool] = []
    owner, method = (NativeRows, "write_checkpoint") if native else (BaseWriter, "write")
    write = getattr(owner, method)

    def held(self: object, *args: object) -> object:
        released.append(gate.wait(timeout=5))  # False: the appends could not go on
        return write(self, *args)

    monkeypatch.setattr(owner, method, held)
    for i in range(3):
        shard.append(rows(i * 10, 2), f"b{i}")  # the third starts the checkpoint
    for i in range(3, 6):
        shard.append(rows(i * 10, 2), f"b{i}")
    gate.set()
    shard.wait_for_checkpoint()
    assert released == [True]
    names = sorted(p.name for p in shard_folder_files(tmp_path))
    base_name = "ckpt-000000000003.duckdb" if native else "base-000000000003.parquet"
    assert [n for n in names if n.startswith(("base-", "ckpt-"))] == [
        base_name,
        *(["ckpt-000000000003.json"] if native else []),
    ]
    assert sum(n.startswith("wal-") for n in names) == 3  # the appends after its LSN
    base = read_base(tmp_path / "tables" / "table-uid" / "0" / base_name)
    assert sorted(base.column("id").to_pylist()) == [0, 1, 10, 11, 20, 21]
    recovered = reopened(tmp_path)
    assert recovered.rows == 12 and recovered.lsn == 6
    assert ids(recovered) == sorted(i * 10 + j for i in range(6) for j in range(2))
    if engine is not None:
        engine.close()


def test_crash_between_new_base_and_log_cleanup_loses_and_doubles_nothing(
    tmp_path: Path,
) -> None:
    shard = shard_at(tmp_path)
    shard.commit_load()
    shard.append(rows(0, 3), "a")
    shard.append(rows(3, 3), "b")
    # The new base is durable but the crash came before the old entries were deleted.
    shard.store.write_base(shard.snapshot(), shard.lsn, {"a": None, "b": None})
    shard.store.append_wal(rows(0, 3), 1, "a")  # a stale entry that the base covers
    shard.append(rows(6, 1), "c")
    recovered = reopened(tmp_path)
    assert ids(recovered) == list(range(7))


def test_a_half_written_entry_is_never_read(tmp_path: Path) -> None:
    shard = shard_at(tmp_path)
    shard.commit_load()
    shard.append(rows(0, 2), "a")
    folder = next(iter(shard_folder_files(tmp_path))).parent
    (folder / "wal-000000000002-torn.arrow.tmp-123").write_bytes(b"\x00\x01")
    assert ids(reopened(tmp_path)) == [0, 1]


def test_a_batch_split_across_shards_lands_once_per_bucket(tmp_path: Path) -> None:
    """One insert's rows reach a shard from two shards that were merged: both parts apply;
    a retry of either part afterwards (same batch id, same buckets) applies nothing."""
    merged = shard_at(tmp_path)
    merged.commit_load()
    part_a, part_b = rows(0, 3), rows(3, 2)
    buckets_a, buckets_b = np.array([1, 1, 2]), np.array([7, 8])
    assert merged.append(part_a, "batch", buckets_a).rows == 3
    assert merged.append(part_b, "batch", buckets_b).rows == 2
    assert merged.append(part_b, "batch", buckets_b).duplicate
    mixed = merged.append(rows(10, 2), "batch", np.array([2, 9]))  # bucket 9 is new
    assert mixed.rows == 1 and ids(merged) == [0, 1, 2, 3, 4, 11]
    recovered = reopened(tmp_path)
    assert recovered.append(part_a, "batch", buckets_a).duplicate
    adopted = shard_at(tmp_path / "other")
    adopted.commit_load()
    adopted.adopt({"batch": [1, 2], "whole": None})
    assert adopted.append(part_a, "batch", buckets_a).duplicate
    assert adopted.append(rows(0, 1), "whole").duplicate
    assert adopted.append(part_b, "batch", buckets_b).rows == 2


def test_wrong_schema_is_refused(tmp_path: Path) -> None:
    shard = shard_at(tmp_path)
    shard.commit_load()
    with pytest.raises((pa.ArrowInvalid, ValueError, KeyError)):
        shard.append(pa.table({"other": [1]}), "x")
    assert shard.rows == 0


def shard_folder_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _slow_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count folder syncs, and make file syncs take a moment (as on a real disk), so that
    appends from several threads meet while one is being written."""
    synced: list[str] = []
    real_fsync, real_fsync_dir = os.fsync, store_module.fsync_dir

    def slow_fsync(fd: int) -> None:
        time.sleep(0.01)  # long enough that the other threads queue, even on a busy machine
        real_fsync(fd)

    def counted(directory: str) -> None:
        synced.append(directory)
        real_fsync_dir(directory)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(store_module, "fsync_dir", counted)
    return synced


def test_concurrent_appends_are_group_committed_and_each_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = shard_at(tmp_path, CheckpointPolicy(max_wal_entries=10_000))
    shard.commit_load()
    synced = _slow_syncs(monkeypatch)
    threads, each = 8, 25
    results: list[object] = []

    def client(n: int) -> None:
        for i in range(each):
            start = (n * each + i) * 10
            results.append(shard.append(rows(start, 10), f"b-{n}-{i}"))

    workers = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    appended = threads * each
    assert sorted(r.lsn for r in results) == list(range(1, appended + 1))  # type: ignore[attr-defined]
    assert not any(r.duplicate for r in results)  # type: ignore[attr-defined]
    # without group commit every append syncs the folder (200); grouped, 40-80 here
    assert len(synced) < appended * 0.75, "appends that met were logged with one folder sync"
    recovered = reopened(tmp_path)
    assert ids(recovered) == list(range(appended * 10))
    assert recovered.lsn == appended


def test_a_batch_sent_twice_at_once_is_applied_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = shard_at(tmp_path)
    shard.commit_load()
    _slow_syncs(monkeypatch)
    buckets = np.array([1, 2, 3, 4])
    results: list[object] = []
    barrier = threading.Barrier(6)

    def send(batch: str) -> None:
        barrier.wait()
        results.append(shard.append(rows(0, 4), batch, buckets))

    senders = [threading.Thread(target=send, args=(f"b{i % 3}",)) for i in range(6)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    assert sum(not r.duplicate for r in results) == 3  # type: ignore[attr-defined]
    assert shard.rows == 12 and reopened(tmp_path).rows == 12


def test_a_group_whose_log_cannot_be_written_fails_whole_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = shard_at(tmp_path)
    shard.commit_load()
    shard.append(rows(0, 2), "kept")

    def full_disk(directory: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "fsync_dir", full_disk)
    with pytest.raises(OSError, match="No space"):
        shard.append(rows(100, 2), "lost")
    monkeypatch.undo()
    assert ids(shard) == [0, 1] and shard.lsn == 1
    assert ids(reopened(tmp_path)) == [0, 1]  # the failed entry's file is gone too
    assert not shard.append(rows(100, 2), "lost").duplicate  # its retry is applied
    assert ids(reopened(tmp_path)) == [0, 1, 100, 101]


def test_a_moves_target_succeeds_its_source_and_a_failover_fences_it(tmp_path: Path) -> None:
    """A live move's target claims the shard at its source's epoch: the fenced source
    still serves reads (it holds every row until the switch) and, if the move rolls back,
    claims it again and takes writes; a failover's holder, at a later epoch, fences the
    source's reads and writes."""
    source = shard_at(tmp_path)
    source.claim("node-0", 3)
    source.append(rows(0, 5), "b1")
    target = reopened(tmp_path)
    target.claim("node-1", None)  # a move's target, at promote
    assert target.store.claimed is not None and target.store.claimed.epoch == 3
    source.check_held()  # reads go on at the source
    with pytest.raises(Moved):
        source.append(rows(5, 5), "b2")  # but no write is acknowledged there
    source = shard_at(tmp_path)  # the source's copy, again (the write retired the other)
    source.claim("node-0", 3, recovering=True)
    source.recover()
    source.claim_again("node-0")  # the move rolled back
    source.append(rows(5, 5), "b3")
    assert ids(reopened(tmp_path)) == list(range(10))
    failover = reopened(tmp_path)
    failover.claim("node-2", 4, recovering=True)
    failover.recover()
    with pytest.raises(Moved):
        source.check_held()
    with pytest.raises(Moved):
        failover.store.claim("node-3", 2)  # a stale catalog's claim is refused


def test_a_targets_claim_in_the_background_comes_before_its_first_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move's target claims the shard on a thread (``claim_soon``, out of the writers'
    pause): an append waits for the claim and is logged under it; a claim that failed is
    made again by the first write; the claim of a target whose move rolls back ends
    before the source claims the shard again."""
    source = shard_at(tmp_path)
    source.claim("node-0", 3)
    source.append(rows(0, 5), "b1")
    target = reopened(tmp_path)
    release = threading.Event()
    writing = ShardStore._write_holders

    def slow_write(store: ShardStore, holders: list[Any]) -> None:
        release.wait(10)
        writing(store, holders)

    monkeypatch.setattr(ShardStore, "_write_holders", slow_write)
    target.claim_soon("node-1")
    done = threading.Event()
    appender = threading.Thread(target=lambda: (target.append(rows(5, 5), "b2"), done.set()))
    appender.start()
    assert not done.wait(0.3)  # the claim is not written yet: nor is the insert
    release.set()
    appender.join(10)
    assert done.is_set()
    holders = target.store.holders()
    assert [h.node for h in holders[-2:]] == ["node-0", "node-1"]
    with pytest.raises(Moved):
        source.append(rows(10, 1), "b3")  # the source is fenced off by the claim
    assert ids(reopened(tmp_path)) == list(range(10))

    failing = iter([OSError("disk full"), None])

    def flaky_write(store: ShardStore, holders: list[Any]) -> None:
        if (error := next(failing, None)) is not None:
            raise error
        writing(store, holders)

    monkeypatch.setattr(ShardStore, "_write_holders", flaky_write)
    again = reopened(tmp_path)
    again.claim_soon("node-2")
    again.append(rows(10, 2), "b4")  # claims again, then writes
    assert again.store.holders()[-1].node == "node-2"
    assert ids(reopened(tmp_path)) == list(range(12))

    monkeypatch.setattr(ShardStore, "_write_holders", slow_write)
    release.clear()
    rolled_back = reopened(tmp_path)
    rolled_back.claim_soon("node-3")
    threading.Timer(0.2, release.set).start()
    rolled_back.await_claim()  # what a roll-back does before the source claims again
    assert rolled_back.store.holders()[-1].node == "node-3"


def test_a_moves_end_leaves_the_appends_kept_for_another_move_of_the_shard(
    tmp_path: Path,
) -> None:
    """Two moves export the shard (a new one began before an older one's roll-back reached
    the source): the older one's end stops only its own record of appends. With one record
    for the shard, the new move lost the appends that followed, and VERIFY rolled it back
    ("holds 9727 rows under the fence but handed out 9719")."""
    shard = shard_at(tmp_path)
    shard.append(rows(0, 10), "b0")
    old_lsn, _, old = shard.begin_streaming_export(1 << 20, "old")
    new_lsn, _, new = shard.begin_streaming_export(1 << 20, "new")
    shard.append(rows(10, 8), "b1")
    shard.end_export("old")  # the old move's roll-back, arriving late
    shard.append(rows(18, 8), "b2")
    kept = shard.changes_since(new_lsn, "new")
    assert [c.batch_id for c in kept] == ["b1", "b2"]
    assert sum(c.rows.num_rows for c in kept) + 10 == shard.rows  # all it holds, handed out
    assert shard.changes_since(old_lsn, "old") == [] and shard.exporting
    old.close()
    new.close()
