"""A worker's shard kept as DuckDB checkpoint files: a restart attaches the newest one and
replays only the log after it, a checkpoint copies the last file and adds the rows logged
since, a pinned snapshot survives the switch to a new file, and a torn or stale file is
refused, never served. Real DuckDB, real files in a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from shardflow.catalog import DataDir
from shardflow.engine import DuckDBEngine
from shardflow.engine.duckdb_engine import NativeRows
from shardflow.errors import StorageError, UnsupportedError
from shardflow.sql.parse import refuse_file_functions
from shardflow.storage import Shard, ShardStore
from shardflow.storage.shard_store import CHECKPOINT_FAULT_VARIABLE, read_checkpoint

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


def rows(start: int, count: int) -> pa.Table:
    ids = list(range(start, start + count))
    return pa.table({"id": ids, "name": [f"r{i}" for i in ids]}, schema=SCHEMA)


class Worker:
    """What a worker keeps of one shard: an engine and the shard's native rows."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.engine = DuckDBEngine(threads=1, file_folders=[str(data)])

    def shard(self) -> tuple[Shard, NativeRows]:
        native = self.engine.native_rows("t_0", SCHEMA, index="id")
        store = ShardStore(DataDir.resolve(str(self.data)), "table-uid", "0")
        return Shard(store, SCHEMA, rows=native), native


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for worker in made:
        worker.engine.close()


def started(workers: list[Worker], data: Path) -> Worker:
    worker = Worker(data)
    workers.append(worker)
    return worker


def folder(data: Path) -> list[str]:
    return sorted(p.name for p in (data / "tables" / "table-uid" / "0").iterdir())


def ids(shard: Shard) -> list[int]:
    return sorted(shard.snapshot().column("id").to_pylist())


def loaded(shard: Shard) -> None:
    """A load of 1000 rows, then five inserts of ten, a checkpoint after the third."""
    shard.stage(rows(0, 1000))
    shard.commit_load()
    for i in range(3):
        shard.append(rows(10_000 + i * 10, 10), f"b{i}")
    shard.checkpoint()
    for i in range(3, 5):
        shard.append(rows(10_000 + i * 10, 10), f"b{i}")


def test_a_restart_attaches_the_checkpoint_and_replays_only_the_log_after_it(
    workers: list[Worker], tmp_path: Path
) -> None:
    shard, _ = started(workers, tmp_path).shard()
    loaded(shard)
    assert shard.lsn == 5
    names = folder(tmp_path)
    assert [n for n in names if n.startswith("ckpt-")] == [
        "ckpt-000000000003.duckdb",
        "ckpt-000000000003.json",
    ]
    assert not any(n.endswith(".parquet") for n in names)
    assert sum(n.startswith("wal-") for n in names) == 2

    again, native = started(workers, tmp_path).shard()
    again.recover()
    assert ids(again) == ids(shard) and again.lsn == 5 and again.rows == 1050
    assert native.checkpoint_lsn == 3  # the file is read where it lies ...
    tail = native.engine.run(f"SELECT count(*) AS n FROM {native.tail}").column("n")[0]
    assert tail.as_py() == 20  # ... and only the two entries after it were loaded
    assert again.append(rows(10_000, 10), "b0").duplicate  # its batch ids came back too
    assert native.indexed()


def test_a_checkpoint_copies_the_last_and_adds_the_log(
    workers: list[Worker], tmp_path: Path
) -> None:
    shard, native = started(workers, tmp_path).shard()
    loaded(shard)
    shard.checkpoint()
    names = folder(tmp_path)
    assert [n for n in names if n.startswith(("ckpt-", "wal-"))] == [
        "ckpt-000000000005.duckdb",
        "ckpt-000000000005.json",
    ]
    meta = shard.store.checkpoint_meta("ckpt-000000000005.duckdb")
    whole = read_checkpoint(str(tmp_path / "tables" / "table-uid" / "0" / names[0]))
    assert (meta.rows, meta.digest) == native.engine.checksum_rows(whole) == native.checksum()
    assert sorted(whole.column("id").to_pylist()) == ids(shard)
    assert native.checkpoint_lsn == 5
    tail = native.engine.run(f"SELECT count(*) AS n FROM {native.tail}").column("n")[0]
    assert tail.as_py() == 0  # every row is read from the file now


def test_a_pinned_snapshot_outlives_the_switch_to_a_new_file(
    workers: list[Worker], tmp_path: Path
) -> None:
    shard, native = started(workers, tmp_path).shard()
    loaded(shard)
    expected = native.checksum()
    lsn, stream = shard.pinned(100)
    shard.append(rows(50_000, 5), "later")
    shard.checkpoint()  # a new base, the old one detached: the snapshot keeps its own
    shard.checkpoint()
    assert stream.checksum() == expected and lsn == 5
    read = []
    while (batch := stream.next()) is not None:
        read += batch.column("id").to_pylist()
    assert sorted(read) == [i for i in ids(shard) if i < 50_000]


@pytest.mark.parametrize("fault", ["torn", "stale"])
def test_a_torn_or_stale_checkpoint_is_refused_never_served(
    workers: list[Worker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """``torn``: the file cut short (its record's size does not match); ``stale``: the
    previous checkpoint's file in its place, its record made to fit (only the LSN the file
    holds tells)."""
    shard, _ = started(workers, tmp_path).shard()
    shard.stage(rows(0, 1000))
    shard.commit_load()
    shard.append(rows(5000, 10), "b0")
    monkeypatch.setenv(CHECKPOINT_FAULT_VARIABLE, fault)
    if fault == "stale":  # the writer reads the file back to switch to it: it notices first
        with pytest.raises(StorageError, match="stale"):
            shard.checkpoint()
    else:
        shard.checkpoint()
    monkeypatch.delenv(CHECKPOINT_FAULT_VARIABLE)
    again, _ = started(workers, tmp_path).shard()
    with pytest.raises(StorageError, match=r"damaged|stale"):
        again.recover()
    assert again.rows == 0


def test_queries_cannot_read_the_files_a_worker_opens(tmp_path: Path) -> None:
    """A worker's DuckDB may open files in the shards' folders; a query calling a
    function that reads files is refused before it gets there."""
    engine = DuckDBEngine(threads=1, file_folders=[str(tmp_path)])
    try:
        (tmp_path / "secret").write_text("another table's bytes")
        reading = f"SELECT count(*) AS n FROM read_blob('{tmp_path}/*')"
        assert engine.run(reading).column("n")[0].as_py() == 1  # what the check keeps out
        with pytest.raises(duckdb.PermissionException):  # elsewhere DuckDB refuses itself
            engine.run("SELECT * FROM read_text('/etc/hostname')")
        for query in (reading, f"SELECT * FROM GLOB('{tmp_path}/*')", "SELECT read_text('x')"):
            with pytest.raises(UnsupportedError, match="not files"):
                refuse_file_functions(query)
        refuse_file_functions("SELECT * FROM t WHERE name GLOB 'r*' AND 'read_csv(' <> name")
    finally:
        engine.close()


def test_an_object_store_data_directory_is_read_through_local_copies(tmp_path: Path) -> None:
    """Where the data directory is not a local folder (pyarrow's in-memory filesystem
    here, as an object store), checkpoints are written locally and put whole, and read
    back through a copy in the worker's local folder, removed once it is not read."""
    store_fs = pafs._MockFileSystem()
    data_dir = DataDir(store_fs, "data", "mock://data")
    scratch = [tmp_path / "one", tmp_path / "two"]
    engines = [DuckDBEngine(threads=1, temp_directory=str(folder)) for folder in scratch]
    try:
        native = engines[0].native_rows("t_0", SCHEMA, index="id")
        shard = Shard(ShardStore(data_dir, "table-uid", "0"), SCHEMA, rows=native)
        loaded(shard)
        stored = store_fs.get_file_info(pafs.FileSelector("data", recursive=True))
        names = sorted(info.base_name for info in stored if info.type == pafs.FileType.File)
        assert names[:2] == ["ckpt-000000000003.duckdb", "ckpt-000000000003.json"]
        native = engines[1].native_rows("t_0", SCHEMA, index="id")
        again = Shard(ShardStore(data_dir, "table-uid", "0"), SCHEMA, rows=native)
        again.recover()
        assert ids(again) == ids(shard) and native.checkpoint_lsn == 3
        assert [p.name for p in scratch[1].iterdir()] == ["table-uid-0-ckpt-000000000003.duckdb"]
        native.drop()
        assert list(scratch[1].iterdir()) == []
    finally:
        for engine in engines:
            engine.close()


def test_a_move_trusts_the_record_of_a_file_read_in_place_and_hashes_a_copy(
    workers: list[Worker], tmp_path: Path
) -> None:
    """A move's target reading the unit's checkpoint file where it lies takes its record's
    sums (the file the source's checksum names); one reading a local copy of it (an
    object store) hashes the copy a step at a time, to the same sum."""
    shard, native = started(workers, tmp_path).shard()
    loaded(shard)
    steps: list[int] = []
    in_place = native.checksum_in_steps(300, lambda nbytes, seconds: steps.append(nbytes))
    assert in_place == native.checksum() and in_place[0] == 1050 and steps == []

    store_fs = pafs._MockFileSystem()
    data_dir = DataDir(store_fs, "data", "mock://data")
    engine = DuckDBEngine(threads=1, temp_directory=str(tmp_path / "scratch"))
    try:
        copied = engine.native_rows("t_0", SCHEMA, index="id")
        loaded(Shard(ShardStore(data_dir, "table-uid", "0"), SCHEMA, rows=copied))
        stepped = copied.checksum_in_steps(300, lambda nbytes, seconds: steps.append(nbytes))
        assert stepped == copied.checksum() == in_place
        assert len(steps) == 4 and all(nbytes > 0 for nbytes in steps)  # 1030 rows in the base
    finally:
        engine.close()


def test_a_file_damaged_where_it_lies_is_refused_as_it_is_read(
    workers: list[Worker], tmp_path: Path
) -> None:
    """What lets a move trust a file's record: DuckDB checks every block's checksum as it
    reads it, so a byte changed in the file fails the read instead of answering."""
    shard, _ = started(workers, tmp_path).shard()
    shard.stage(rows(0, 200_000))
    shard.commit_load()
    again, native = started(workers, tmp_path).shard()
    again.recover()
    [path] = (tmp_path / "tables" / "table-uid" / "0").glob("ckpt-*.duckdb")
    with open(path, "rb+") as handle:  # a byte in each block after the file's headers
        for offset in range(3 * 4096 + 64, path.stat().st_size, 256 * 1024):
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(duckdb.Error, match="checksum"):
        native.checksum()


def test_a_checkpoint_gone_since_it_was_listed_is_listed_again_not_called_damaged(
    workers: list[Worker], tmp_path: Path
) -> None:
    """A move's target lists the folder while the source checkpoints: a file superseded
    meanwhile is ``FileNotFoundError`` (recovery lists again); a file whose record is
    missing is damage."""
    shard, _ = started(workers, tmp_path).shard()
    loaded(shard)
    with pytest.raises(FileNotFoundError):
        shard.store.checkpoint_meta("ckpt-000000000001.duckdb")  # superseded by the one at 3
    (tmp_path / "tables" / "table-uid" / "0" / "ckpt-000000000003.json").unlink()
    with pytest.raises(StorageError, match="no record"):
        shard.store.checkpoint_meta("ckpt-000000000003.duckdb")
