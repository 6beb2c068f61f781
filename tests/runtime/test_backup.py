"""Online backups (``storage/backup.py``) of a cluster that takes inserts, moves and splits
while its files are copied, restored into a new data directory and served by a cluster of
another size. In process: real workers, DuckDB, files; no mocks. The promise checked: every
batch acknowledged before the backup began is in it, and every batch in it is whole.

``SHARDFLOW_TEST_UNFENCED=backup-hold`` lets checkpoints delete the log entries a backup
still needs; :func:`test_a_batch_seen_in_one_cut_is_taken_whole_from_the_others` then fails."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from shardflow.catalog import DataDir
from shardflow.errors import ConfigError, StorageError
from shardflow.runtime.worker.moves import TargetSide
from shardflow.runtime.worker.node import WorkerNode
from shardflow.storage import backup as backups
from shardflow.storage.holds import ARCHIVE_FOLDER
from shardflow.storage.shard_store import UNFENCED_VARIABLE
from tests.support.local_cluster import LocalCluster, events

BATCH = 100
BASE = 1_000_000


def batch(index: int) -> pa.Table:
    """Batch ``index``: ids ``BASE + index * BATCH`` on, over every unit of the table."""
    return events(BASE + index * BATCH, BATCH)


def batches_held(cluster: LocalCluster) -> dict[int, int]:
    """Rows held per batch index."""
    rows = cluster.sql(
        f"SELECT (id - {BASE}) // {BATCH} AS b, count(*) AS n FROM events "
        f"WHERE id >= {BASE} GROUP BY b"
    )
    return dict(zip(rows.column("b").to_pylist(), rows.column("n").to_pylist(), strict=True))


def restored(tmp_path: Path, root: str, backup_id: str, nodes: int) -> LocalCluster:
    target = tmp_path / f"restored-{backup_id}"
    backups.restore(root, DataDir.resolve(str(target)), backup_id)
    return LocalCluster(target, nodes=nodes)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "data", nodes=3, wal_checkpoint_entries=2)
    cluster.create_table("events", events(0, 3000), "id")
    assert len(cluster.units("events")) >= 3
    yield cluster
    cluster.close()


def checkpoint_all(cluster: LocalCluster) -> None:
    for node in cluster.catalog.nodes:
        for shard in list(cluster.workers.get(node).node.shards.values()):
            shard.checkpoint()


def test_a_batch_seen_in_one_cut_is_taken_whole_from_the_others(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backup cuts the shards one after another. Batch 1 comes after the first shard's
    cut and before the others': the backup sees it and must take the first shard's part
    too, from its log, though a checkpoint covered that part meanwhile. Batch 2 comes after
    every cut: none of it may be in the backup."""
    cluster.insert("events", batch(0), "b0")
    copy_unit = backups._Backup._copy_unit
    complete = backups._Backup._complete
    cut = itertools.count()

    def copy_then_insert(self: Any, uid: str, shard: str) -> Any:
        copied = copy_unit(self, uid, shard)
        if next(cut) == 0:
            cluster.insert("events", batch(1), "b1")
        return copied

    def insert_then_complete(self: Any, *args: Any) -> int:
        if not getattr(self, "late", False):
            self.late = True
            cluster.insert("events", batch(2), "b2")
            checkpoint_all(cluster)  # covers batch 1's entries: the hold must keep them
        return complete(self, *args)

    monkeypatch.setattr(backups, "COPY_THREADS", 1)  # the cuts one after another
    monkeypatch.setattr(backups._Backup, "_copy_unit", copy_then_insert)
    monkeypatch.setattr(backups._Backup, "_complete", insert_then_complete)
    root = str(tmp_path / "backups")
    info = backups.backup(DataDir.resolve(cluster.data_dir), root)
    assert batches_held(cluster) == {0: BATCH, 1: BATCH, 2: BATCH}
    cluster.close()
    again = restored(tmp_path, root, info.backup_id, nodes=2)
    try:
        assert batches_held(again) == {0: BATCH, 1: BATCH}
        assert (
            again.sql("SELECT count(*) AS n FROM events WHERE id < 3000").column("n")[0].as_py()
            == 3000
        )
    finally:
        again.close()


def test_a_part_held_by_a_moves_fence_is_waited_for(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move holds its unit's writes at the fence for longer than the backup's settling
    time; a batch inserted then is durable on the other units and waits there. The backup
    sees it, and must wait for the move to end and take the held part too."""
    # the last unit: in process, a batch's parts are sent node by node in unit order, so
    # the parts of the other units are logged while this one's waits at the fence
    unit = cluster.units("events")[-1]
    assert all(u.node != unit.node for u in cluster.units("events")[:-1])
    target = next(n for n in cluster.catalog.nodes if n != unit.node)
    apply_final = TargetSide.apply_final
    fenced = threading.Event()

    def slow_apply(self: Any, *args: Any) -> Any:
        fenced.set()  # the sources are fenced: writes to the unit wait
        time.sleep(4 * backups.SETTLE_S)
        return apply_final(self, *args)

    monkeypatch.setattr(TargetSide, "apply_final", slow_apply)
    mover = threading.Thread(target=cluster.migrate, args=(unit.unit_id, target))
    mover.start()
    assert fenced.wait(30)
    assert backed_up_while_a_part_waits(cluster, tmp_path, mover) == {0: BATCH}


@pytest.mark.parametrize("left_out", [False, True], ids=["waited-for", "left-out"])
def test_a_batch_held_in_part_by_a_slow_worker_is_waited_for_or_left_out_whole(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left_out: bool
) -> None:
    """A worker slow to log its part (as a retry after a failover is): the other parts are
    durable, and the entries say which units the batch went to. The backup waits for the
    missing part, or, past ``PART_WAIT_S``, leaves the batch out whole (it was never
    acknowledged by then)."""
    last = cluster.units("events")[-1]
    append = WorkerNode.append
    slow_s = 4 * backups.SETTLE_S

    def slow_append(self: WorkerNode, table: str, parts: Any, *args: Any, **kwargs: Any) -> Any:
        if last.unit_id in parts:  # in process the parts go node by node, this one last
            time.sleep(slow_s)
        return append(self, table, parts, *args, **kwargs)

    monkeypatch.setattr(WorkerNode, "append", slow_append)
    if left_out:
        monkeypatch.setattr(backups, "PART_WAIT_S", backups.SETTLE_S)
    held = backed_up_while_a_part_waits(cluster, tmp_path)
    assert held == ({} if left_out else {0: BATCH})


def backed_up_while_a_part_waits(
    cluster: LocalCluster, tmp_path: Path, *running: threading.Thread
) -> dict[int, int]:
    """Insert batch 0 across every unit; once every part but the last is logged, back up;
    then (the insert and ``running`` done) restore on 2 workers: the rows held per batch."""
    inserter = threading.Thread(target=cluster.insert, args=("events", batch(0), "b0"))
    inserter.start()
    while len(batches_held_on_disk(cluster)) < len(cluster.units("events")) - 1:
        time.sleep(0.01)
    root = str(tmp_path / "backups")
    info = backups.backup(DataDir.resolve(cluster.data_dir), root)
    for thread in (inserter, *running):
        thread.join()
    cluster.close()
    again = restored(tmp_path, root, info.backup_id, nodes=2)
    try:
        return batches_held(again)
    finally:
        again.close()


def batches_held_on_disk(cluster: LocalCluster) -> list[str]:
    """The log entries the table's shards have on disk now."""
    spec = cluster.catalog.table("events")
    return [str(p) for p in Path(cluster.data_dir, "tables", spec.uid).glob("*/wal-*.arrow")]


class Load:
    """Two inserters of numbered batches and a mover (a split every third round, where
    ``splits``) on threads while the ``with`` block runs; a failed operation is kept."""

    def __init__(self, cluster: LocalCluster, *, splits: bool) -> None:
        self.cluster = cluster
        self.splits = splits
        self.began: dict[int, float] = {}
        self.acked: dict[int, float] = {}
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.counter = itertools.count()
        self.threads = [threading.Thread(target=self._insert) for _ in range(2)]
        self.threads.append(threading.Thread(target=self._move))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def wait_for(self, count: int) -> None:
        """Until ``count`` batches are acknowledged (or an operation failed)."""
        while len(self.acked) < count and not self.errors:
            time.sleep(0.02)

    def _insert(self) -> None:
        while not self.stop.is_set():
            index = next(self.counter)
            self.began[index] = time.time()
            try:
                self.cluster.insert("events", batch(index), f"b{index}")
            except BaseException as error:  # a failed insert fails the test
                self.errors.append(error)
                return
            self.acked[index] = time.time()

    def _move(self) -> None:
        cluster = self.cluster
        for round_ in itertools.count():
            if self.stop.is_set():
                return
            units = cluster.units("events")
            unit = units[round_ % len(units)]
            try:
                if self.splits and round_ % 3 == 2 and len(units) < 8:
                    cluster.split(unit.unit_id)
                else:
                    target = next(n for n in cluster.catalog.nodes if n != unit.node)
                    cluster.migrate(unit.unit_id, target)
            except BaseException as error:
                self.errors.append(error)
                return


def test_under_inserts_moves_and_splits_every_acknowledged_batch_is_kept_whole(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    root = str(tmp_path / "backups")
    taken: list[tuple[float, backups.BackupInfo]] = []
    with Load(cluster, splits=True) as load:
        load.wait_for(20)
        for _ in range(2):
            began = time.time()
            taken.append((began, backups.backup(DataDir.resolve(cluster.data_dir), root)))
            load.wait_for(20 + 20 * len(taken))
    acked, errors = load.acked, load.errors
    assert not errors, errors
    assert backups.verify(root).ok
    cluster.close()
    for began, info in taken:
        again = restored(tmp_path, root, info.backup_id, nodes=2)
        try:
            held = batches_held(again)
            before = {i for i, at in acked.items() if at < began}
            assert before <= set(held), (
                f"acknowledged before the backup, not in it: {before - set(held)}"
            )
            assert all(n == BATCH for n in held.values()), {
                i: n for i, n in held.items() if n != BATCH
            }
            total = again.sql(
                "SELECT count(*) AS n, count(DISTINCT id) AS d FROM events"
            ).to_pylist()
            assert total == [{"n": 3000 + BATCH * len(held), "d": 3000 + BATCH * len(held)}]
        finally:
            again.close()


def test_the_next_backup_writes_only_what_changed(cluster: LocalCluster, tmp_path: Path) -> None:
    """Shards of several DuckDB row groups (122,880 rows each): a checkpoint after a few
    inserts rewrites the last one's blocks, and the backup after it writes those."""
    cluster.create_table("big", events(BASE, 3 * 200_000), "id")
    root = str(tmp_path / "backups")
    source = DataDir.resolve(cluster.data_dir)
    first = backups.backup(source, root)
    again = backups.backup(source, root)
    assert again.bytes == first.bytes and again.bytes_written == 0
    for index in range(6):
        cluster.insert("big", events(10 * BASE + index * BATCH, BATCH), f"b{index}")
    checkpoint_all(cluster)  # each a copy of the shard's file with the rows added
    checkpointed = backups.backup(source, root)
    assert 0 < checkpointed.bytes_written < checkpointed.bytes / 4, checkpointed
    cluster.close()
    again_served = restored(tmp_path, root, checkpointed.backup_id, nodes=3)
    try:
        counted = again_served.sql("SELECT count(*) AS n FROM big").column("n")[0].as_py()
        assert counted == 3 * 200_000 + 6 * BATCH
    finally:
        again_served.close()


def test_a_damaged_backup_is_found_by_verify_and_refused_by_restore(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    root = tmp_path / "backups"
    info = backups.backup(DataDir.resolve(cluster.data_dir), str(root))
    assert backups.verify(str(root)).ok
    pack = next((root / "packs").iterdir())
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    report = backups.verify(str(root))
    assert not report.ok and "does not match its checksum" in report.problems[0]
    target = tmp_path / "restored"
    with pytest.raises(StorageError, match="does not match its checksum"):
        backups.restore(str(root), DataDir.resolve(str(target)), info.backup_id)
    assert not (target / "catalog").exists() or not any((target / "catalog").iterdir())
    assert not (target / "tables").exists()
    manifest = root / "backups" / f"{info.backup_id}.json"
    record = json.loads(manifest.read_text())
    record["catalog"]["version"] += 1
    manifest.write_text(json.dumps(record))
    with pytest.raises(StorageError, match="does not match its checksum"):
        backups.read_manifest(backups.open_root(str(root), create=False), info.backup_id)


def test_the_copy_runs_at_the_priority_asked_and_bad_options_are_refused(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy_unit = backups._Backup._copy_unit
    policies: set[int] = set()

    renewing: set[int] = set()

    def noting_policy(self: Any, *args: Any) -> Any:
        policies.add(os.sched_getscheduler(0))  # this thread's
        for thread in threading.enumerate():  # the hold's renewer: never starved with it
            if thread.name.startswith("hold-backup-") and thread.native_id is not None:
                renewing.add(os.sched_getscheduler(thread.native_id))
        return copy_unit(self, *args)

    monkeypatch.setattr(backups._Backup, "_copy_unit", noting_policy)
    source = DataDir.resolve(cluster.data_dir)
    backups.backup(source, str(tmp_path / "b"), max_rate_mb_s=1000)
    assert policies == {os.SCHED_IDLE}
    assert renewing == {os.SCHED_OTHER}
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's thread keeps its own
    policies.clear()
    backups.backup(source, str(tmp_path / "b"), priority="normal")
    assert policies == {os.sched_getscheduler(0)}
    with pytest.raises(ConfigError, match="priority must be one of idle, low, normal"):
        backups.backup(source, str(tmp_path / "b"), priority="urgent")
    with pytest.raises(ConfigError, match="max_rate_mb_s"):
        backups.backup(source, str(tmp_path / "b"), max_rate_mb_s=-1)


def test_restore_refuses_a_data_directory_that_holds_data(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    root = str(tmp_path / "backups")
    backups.backup(DataDir.resolve(cluster.data_dir), root)
    with pytest.raises(StorageError, match="holds shardflow data already"):
        backups.restore(root, DataDir.resolve(cluster.data_dir))
    with pytest.raises(StorageError, match="no backups"):
        backups.restore(str(tmp_path / "nowhere"), DataDir.resolve(str(tmp_path / "new")))
    with pytest.raises(StorageError, match="no shardflow data"):
        backups.backup(DataDir.resolve(str(tmp_path / "empty")), root)


@pytest.mark.skipif(os.environ.get(UNFENCED_VARIABLE) is not None, reason="hooks set outside")
def test_without_the_hold_a_checkpoint_takes_what_the_backup_needs(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault hook's own check: with the hold ignored, the first test's backup fails."""
    monkeypatch.setenv(UNFENCED_VARIABLE, "backup-hold")
    with pytest.raises((StorageError, AssertionError)):
        test_a_batch_seen_in_one_cut_is_taken_whole_from_the_others(cluster, tmp_path, monkeypatch)


def archived_entries(cluster: LocalCluster) -> list[str]:
    folder = Path(cluster.data_dir) / ARCHIVE_FOLDER
    return [p.name for p in folder.rglob("wal-*.arrow")] if folder.exists() else []


def test_a_time_between_two_backups_is_restored_from_the_log_they_kept(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """With the log kept, the checkpoints between two backups archive the entries they
    cover instead of deleting them, and the second backup takes them (then the archive is
    emptied). A restore as of a time between the two holds every batch acknowledged by then
    and none after, each whole, on a cluster of another size."""
    root = str(tmp_path / "backups")
    source = DataDir.resolve(cluster.data_dir)
    first = backups.backup(source, root, keep_log=True)
    for index in range(4):
        cluster.insert("events", batch(index), f"b{index}")
    checkpoint_all(cluster)  # covers batches 0-3: the log keeps them
    time.sleep(0.05)
    at = time.time()
    time.sleep(0.05)
    for index in range(4, 7):
        cluster.insert("events", batch(index), f"b{index}")
    checkpoint_all(cluster)
    archived = archived_entries(cluster)
    second = backups.backup(source, root)
    left = archived_entries(cluster)
    assert first.finished_at < at < second.started_at
    cluster.close()
    target = tmp_path / "as-of"
    info = backups.restore(root, DataDir.resolve(str(target)), as_of=at)
    assert info.backup_id == first.backup_id
    again = LocalCluster(target, nodes=2)
    try:
        assert batches_held(again) == {i: BATCH for i in range(4)}, "not as it was then"
        assert (
            again.sql("SELECT count(*) AS n FROM events WHERE id < 3000").column("n")[0].as_py()
            == 3000
        )
    finally:
        again.close()
    assert archived, "the checkpoints archived nothing"
    assert left == [], "the second backup left the archive it took"


def test_a_time_between_backups_under_inserts_and_moves_has_what_was_acknowledged_by_then(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Two inserters and a mover run through both backups (the shards checkpoint every
    second entry). Restored as of a time between them: every batch acknowledged before it,
    none begun after it, each whole."""
    root = str(tmp_path / "backups")
    source = DataDir.resolve(cluster.data_dir)
    with Load(cluster, splits=False) as load:
        load.wait_for(10)
        backups.backup(source, root, keep_log=True)
        load.wait_for(len(load.acked) + 20)
        at = time.time()
        load.wait_for(len(load.acked) + 20)
        backups.backup(source, root)
    acked, began, errors = load.acked, load.began, load.errors
    assert not errors, errors
    cluster.close()
    target = tmp_path / "as-of"
    backups.restore(root, DataDir.resolve(str(target)), as_of=at)
    again = LocalCluster(target, nodes=2)
    try:
        held = batches_held(again)
    finally:
        again.close()
    before = {i for i, when in acked.items() if when < at}
    assert before <= set(held), f"acknowledged by then, not restored: {before - set(held)}"
    after = {i for i, when in began.items() if when > at}
    assert not after & set(held), f"begun after it, restored: {after & set(held)}"
    assert all(n == BATCH for n in held.values()), {i: n for i, n in held.items() if n != BATCH}


@pytest.mark.skipif(os.environ.get(UNFENCED_VARIABLE) is not None, reason="hooks set outside")
def test_without_the_kept_log_a_time_between_backups_loses_rows(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault hook's own check: checkpoints that delete what they cover though the log
    is to be kept make the restore as of a time between backups lose batches."""
    monkeypatch.setenv(UNFENCED_VARIABLE, "keep-log")
    with pytest.raises(AssertionError, match="not as it was then"):
        test_a_time_between_two_backups_is_restored_from_the_log_they_kept(cluster, tmp_path)


def test_a_time_that_cannot_be_put_together_is_refused_saying_why(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Before the first backup, after the last, without the log kept, and across a change
    other than inserts (a split): each refused, nothing written."""
    root = str(tmp_path / "backups")
    source = DataDir.resolve(cluster.data_dir)
    target = DataDir.resolve(str(tmp_path / "as-of"))
    backups.backup(source, root)  # the log not kept
    between = time.time()
    time.sleep(0.05)
    kept = backups.backup(source, root, keep_log=True)
    with pytest.raises(StorageError, match="was finished by"):
        backups.restore(root, target, as_of=kept.started_at - 3600)
    with pytest.raises(StorageError, match="the log was not kept"):
        backups.restore(root, target, as_of=between)
    with pytest.raises(StorageError, match="take one"):
        backups.restore(root, target, as_of=time.time())
    cluster.insert("events", batch(0), "b0")
    after_insert = time.time()
    cluster.split(cluster.units("events")[0].unit_id)
    backups.backup(source, root)
    with pytest.raises(StorageError, match="events changed other than by inserts"):
        backups.restore(root, target, as_of=after_insert)
    with pytest.raises(ConfigError, match="not both"):
        backups.restore(root, target, kept.backup_id, as_of=after_insert)
    assert not (tmp_path / "as-of").exists() or not any((tmp_path / "as-of").iterdir())


def test_prune_keeps_the_newest_backups_and_the_packs_they_name(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A pack goes once no kept backup names a chunk of it: here the first backup's, of a
    table truncated since (its files gone from every later backup)."""
    root = str(tmp_path / "backups")
    source = DataDir.resolve(cluster.data_dir)
    taken = [backups.backup(source, root)]
    cluster.session.truncate_table("events")
    for index in range(2):
        cluster.insert("events", batch(index), f"b{index}")
        taken.append(backups.backup(source, root))
    packs = tmp_path / "backups" / "packs"
    before = {p.name for p in packs.iterdir()}
    report = backups.prune(root, keep=2)
    assert report.backups == [taken[0].backup_id]
    assert backups.backups(backups.open_root(root, create=False)) == [
        t.backup_id for t in taken[1:]
    ]
    after = {p.name for p in packs.iterdir()}
    assert not any(name.startswith(taken[0].backup_id) for name in after)
    assert after < before and report.packs == len(before - after) and report.bytes > 0
    assert backups.verify(root).ok  # what is left names no pack gone
    cluster.close()
    served = restored(tmp_path, root, taken[1].backup_id, nodes=2)
    try:
        assert batches_held(served) == {0: BATCH}
        assert served.sql("SELECT count(*) AS n FROM events").column("n")[0].as_py() == BATCH
    finally:
        served.close()
    with pytest.raises(ConfigError, match="keep must be 1 or more"):
        backups.prune(root, keep=0)


def test_a_prune_and_a_backup_never_run_on_one_folder_at_once(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "backups")
    source = DataDir.resolve(cluster.data_dir)
    first = backups.backup(source, root)
    copy = backups._Backup._copy_consistent

    def prune_meanwhile(self: Any) -> Any:
        with pytest.raises(StorageError, match="a backup runs there since"):
            backups.prune(root, keep=1)
        # a prune begun in the same moment (its look came before this backup's marker):
        # it deletes the packs this backup reuses, and the backup must not name them
        for pack in (tmp_path / "backups" / "packs").iterdir():
            pack.unlink()
        return copy(self)

    monkeypatch.setattr(backups._Backup, "_copy_consistent", prune_meanwhile)
    with pytest.raises(StorageError, match="packs it reuses were deleted"):
        backups.backup(source, root)
    assert backups.backups(backups.open_root(root, create=False)) == [first.backup_id]
    marker = tmp_path / "backups" / "markers" / f"pruning-{time.time():.6f}-abc"
    marker.write_bytes(b"")
    monkeypatch.undo()
    with pytest.raises(StorageError, match="a prune runs there since"):
        backups.backup(source, root)
    marker.unlink()
    assert backups.backup(source, root).bytes_written > 0  # its packs were deleted: again


def test_a_backup_on_a_filesystem_that_is_not_a_local_folder(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object-store paths (no fsync, output streams, reads at an offset): the root and
    the restored data directory through Arrow's SubTreeFileSystem, which is not a local
    folder to shardflow, as S3 or GCS is not."""
    import pyarrow.fs as pafs

    def remote(uri: str) -> DataDir:
        folder = Path(uri)
        folder.mkdir(parents=True, exist_ok=True)
        fs = pafs.SubTreeFileSystem(str(folder), pafs.LocalFileSystem())
        return DataDir(fs, "", f"remote://{uri}")

    monkeypatch.setattr(backups, "open_root", lambda uri, create: remote(uri))
    root = str(tmp_path / "bucket")
    cluster.insert("events", batch(0), "b0")
    first = backups.backup(DataDir.resolve(cluster.data_dir), root)
    assert not remote(root).local and first.bytes_written > 0
    assert backups.verify(root).ok
    cluster.close()
    target = remote(str(tmp_path / "restored"))
    backups.restore(root, target, first.backup_id)
    served = LocalCluster(tmp_path / "restored", nodes=2)
    try:
        assert batches_held(served) == {0: BATCH}
        assert served.sql("SELECT count(*) AS n FROM events").column("n")[0].as_py() == 3100
    finally:
        served.close()
