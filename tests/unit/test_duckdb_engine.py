"""The DuckDB engine: it closes while other threads still run queries on it (what a
session's close() does under calls in flight), views inlined as CTEs answer like temporary
views, and new rows are compressed in the background, not inside a commit."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator

import duckdb
import pyarrow as pa
import pytest

from shardflow.engine import DuckDBEngine, duckdb_engine
from shardflow.engine.duckdb_engine import NativeRows, with_views


def test_close_while_queries_run_goes_through() -> None:
    engine = DuckDBEngine()
    rows = pa.table({"a": pa.array(range(2_000_000), pa.int64())})
    running = threading.Barrier(3)
    errors: list[BaseException] = []

    def busy() -> None:
        running.wait()
        try:
            while True:
                engine.run("SELECT sum(a * a) FROM t", {"t": rows})
        except duckdb.Error as error:
            errors.append(error)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    running.wait()
    time.sleep(0.3)  # both threads are inside DuckDB now, most of the time
    engine.close()  # DuckDB refuses a close that meets a running call; the engine insists
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all("closed" in str(e) for e in errors), errors


def test_duckdbs_refusal_of_a_stage_is_told_from_an_error_in_the_data() -> None:
    from shardflow.engine import query_error
    from shardflow.errors import QueryError, StageRefused

    con = duckdb.connect()
    refusals = ["SELECT nosuch FROM range(3)", "SELEC 1", "SELECT * FROM nosuch"]
    for sql in refusals:
        try:
            con.sql(sql)
        except duckdb.Error as error:
            assert isinstance(query_error(error), StageRefused), sql
    try:
        con.sql("SELECT 'abc'::INTEGER").fetchall()
    except duckdb.Error as error:
        mapped = query_error(error)
        assert type(mapped) is QueryError and "abc" in str(mapped)


VIEW_QUERIES = [
    "SELECT count(*), sum(v) FROM t WHERE k > 10",
    "select k FROM t WHERE k < 3 ORDER BY k",
    "WITH small AS (SELECT * FROM t WHERE k < 5) SELECT count(*) FROM small",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 4) "
    "SELECT count(*) FROM r, t WHERE t.k = r.n",
    "SELECT count(*) FROM t AS a JOIN t AS b ON a.k = b.k",  # read twice: not materialized
    "(SELECT max(k) FROM t) UNION ALL (SELECT min(k) FROM t)",  # not SELECT/WITH: a view
    "WITH t AS (SELECT 1 AS k, 2 AS v) SELECT * FROM t",  # its own t: a view, shadowed
]


def test_per_call_views_are_inlined_as_ctes_and_answer_as_temporary_views() -> None:
    engine = DuckDBEngine(threads=1)
    part = pa.table({"k": pa.array(range(100), pa.int64()), "v": range(100)})
    engine.execute("CREATE TABLE p1 AS SELECT * FROM part WHERE k < 50", {"part": part})
    engine.execute("CREATE TABLE p2 AS SELECT * FROM part WHERE k >= 50", {"part": part})
    engine.execute("CREATE TABLE t AS SELECT 1000 AS k, 1 AS v")  # the standing table
    views = {"t": 'SELECT * FROM "p1" UNION ALL SELECT * FROM "p2"'}
    reference = duckdb.connect()
    reference.register("t", part)
    for sql in VIEW_QUERIES:
        expected = reference.sql(sql).to_arrow_table()
        got = engine.run(sql, {}, views)
        assert got.to_pylist() == expected.to_pylist(), sql


def test_a_view_is_inlined_only_where_it_reads_the_same() -> None:
    views = {"t": 'SELECT * FROM "p1"'}
    assert with_views("SELECT * FROM t", views) == (
        'WITH "t" AS NOT MATERIALIZED (SELECT * FROM "p1") SELECT * FROM t'
    )
    assert with_views("WITH a AS (SELECT 1) SELECT * FROM a, t", views) == (
        'WITH "t" AS NOT MATERIALIZED (SELECT * FROM "p1"), a AS (SELECT 1) SELECT * FROM a, t'
    )
    assert with_views("(SELECT 1) UNION (SELECT 2)", views) is None
    assert with_views("WITH t AS (SELECT 1) SELECT * FROM t", views) is None
    assert with_views('WITH "t" AS (SELECT 1) SELECT * FROM t', views) is None


def test_memory_is_read_while_other_threads_read_it_too() -> None:
    engine = DuckDBEngine(threads=1)
    errors: list[BaseException] = []

    def look() -> None:
        try:
            for _ in range(200):
                engine.memory()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=look) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


# -- compaction of new rows ----------------------------------------------------------------
AFTER_BYTES = 2 << 20
MakeEngine = Callable[..., DuckDBEngine]


@pytest.fixture
def make_engine() -> Iterator[MakeEngine]:
    """DuckDB engines of one thread, closed after the test whatever it ends with."""
    made: list[DuckDBEngine] = []

    def make(**options: int) -> DuckDBEngine:
        made.append(DuckDBEngine(threads=1, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _rows(first: int, count: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(first, first + count), pa.int64()),
            "tag": pa.array([f"tag-{i % 40}" for i in range(count)], pa.string()),
        }
    )


def _fill(rows: NativeRows, count: int = 600_000) -> None:
    for first in range(0, count, 100_000):
        rows.append(_rows(first, 100_000))


def _compressed_segments(engine: DuckDBEngine, rows: NativeRows) -> int:
    info = engine.run(f"SELECT compression FROM pragma_storage_info('{rows.physical}.rows')")
    assert info.num_rows > 0
    return sum(kind != "Uncompressed" for kind in info.column("compression").to_pylist())


def _wait_for_compaction(engine: DuckDBEngine, runs: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.compactor.runs < runs:
        assert time.monotonic() < deadline, "no compaction ran"
        time.sleep(0.02)


def test_duckdb_never_checkpoints_inside_a_commit(make_engine: MakeEngine) -> None:
    """DuckDB's own checkpoints run inside the commit that crosses its threshold (an
    INSERT waited seconds while the whole database was compressed): they are off."""
    engine = make_engine()
    setting = engine.run("SELECT current_setting('checkpoint_threshold') AS v")
    size, unit = setting.column("v")[0].as_py().split()
    gib = float(size) * {"GiB": 1, "TiB": 1 << 10, "PiB": 1 << 20}.get(unit, 0)
    assert gib >= 1 << 10, setting  # 1 TiB at least: never reached


def test_new_rows_are_compressed_in_the_background(make_engine: MakeEngine) -> None:
    engine = make_engine(compact_after_bytes=AFTER_BYTES)
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    chunk = _rows(0, 100_000)
    assert chunk.nbytes < AFTER_BYTES  # the first append is not enough
    rows.append(chunk)
    time.sleep(0.2)
    assert engine.compactor.runs == 0 and _compressed_segments(engine, rows) == 0
    for first in range(100_000, 600_000, 100_000):
        rows.append(_rows(first, 100_000))
    _wait_for_compaction(engine, 1)
    assert _compressed_segments(engine, rows) > 0
    assert engine.run(f"SELECT count(*) AS n, sum(id) AS s FROM {rows.ref}").to_pylist() == [
        {"n": 600_000, "s": sum(range(600_000))}
    ]


def test_settle_compresses_what_is_below_the_threshold(make_engine: MakeEngine) -> None:
    """The end of bulk work (a load) settles its shards: their last rows, too few for the
    compactor to get at by themselves, are compressed all the same."""
    engine = make_engine(compact_after_bytes=AFTER_BYTES)
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    empty = engine.native_rows("t_2", _rows(0, 0).schema)
    rows.append(_rows(0, 100_000))
    empty.settle()  # nothing appended: nothing to do
    time.sleep(0.2)
    assert engine.compactor.runs == 0 and _compressed_segments(engine, rows) == 0
    rows.settle()
    _wait_for_compaction(engine, 1)
    assert _compressed_segments(engine, rows) > 0
    time.sleep(0.2)
    assert engine.compactor.runs == 1  # the empty one was left alone


def test_a_checkpoint_holds_up_appends_to_its_own_shard_only(make_engine: MakeEngine) -> None:
    """Each shard has a database of its own: compressing one (which blocks appends to the
    database it writes for as long as it takes) leaves the others' inserts alone."""
    engine = make_engine(compact_after_bytes=1 << 40)
    big = engine.native_rows("t_big", _rows(0, 0).schema)
    small = engine.native_rows("t_small", _rows(0, 0).schema)
    _fill(big, 1_500_000)
    compacting = threading.Thread(target=big.compact)
    compacting.start()
    time.sleep(0.05)
    waits = []
    while compacting.is_alive():
        started = time.perf_counter()
        small.append(_rows(0, 10))
        waits.append(time.perf_counter() - started)
    compacting.join()
    assert waits and _compressed_segments(engine, big) > 0
    assert small.rows == 10 * len(waits)
    # the appends went on while the big shard was compressed, rather than after it
    assert len(waits) > 1 and max(waits) < sum(waits), waits


def test_bulk_work_holds_compaction_back_until_it_ends(make_engine: MakeEngine) -> None:
    engine = make_engine(compact_after_bytes=AFTER_BYTES)
    held = engine.native_rows("t_held", _rows(0, 0).schema)
    free = engine.native_rows("t_free", _rows(0, 0).schema)
    release = engine.compactor.hold(["t_held"])
    _fill(held)
    _fill(free)  # not held: compressed while the other one waits
    _wait_for_compaction(engine, 1)
    time.sleep(0.3)
    assert _compressed_segments(engine, held) == 0
    assert _compressed_segments(engine, free) > 0
    assert engine.compactor.held == 1
    runs = engine.compactor.runs
    release()
    release()  # once is enough; again is harmless
    assert engine.compactor.held == 0
    _wait_for_compaction(engine, runs + 1)
    assert _compressed_segments(engine, held) > 0


def test_a_hold_defers_compaction_only_for_a_while(
    monkeypatch: pytest.MonkeyPatch, make_engine: MakeEngine
) -> None:
    monkeypatch.setattr(duckdb_engine, "DEFER_AT_MOST_S", 0.3)
    engine = make_engine(compact_after_bytes=AFTER_BYTES)
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    engine.compactor.hold(["t_1"])  # never released: a move whose coordinator went away
    _fill(rows)
    _wait_for_compaction(engine, 1)
    assert _compressed_segments(engine, rows) > 0


def test_a_dropped_shard_is_forgotten_and_its_readers_finish(make_engine: MakeEngine) -> None:
    engine = make_engine(compact_after_bytes=AFTER_BYTES)
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    engine.compactor.hold(["t_1"])
    _fill(rows)
    stream = rows.stream(100_000)
    first = stream.next()
    rows.drop()  # the database goes; the pinned reader still reads it to the end
    seen = first.num_rows if first is not None else 0
    while (batch := stream.next()) is not None:
        seen += batch.num_rows
    assert seen == 600_000
    with pytest.raises(duckdb.Error):
        engine.run(f"SELECT count(*) FROM {rows.ref}")
    assert not engine.compactor._pending


def test_close_stops_the_compactor() -> None:
    engine = DuckDBEngine(threads=1, compact_after_bytes=AFTER_BYTES)
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    engine.compactor.hold(["t_1"])
    _fill(rows)
    thread = engine.compactor._thread
    assert thread is not None and thread.is_alive()
    engine.close()
    assert not thread.is_alive()


def test_a_pinned_snapshot_closes_quietly_after_its_engine() -> None:
    """A background checkpoint still reading a shard when its worker stops closes its
    snapshot after the engine is gone: that must not raise in the checkpoint's thread."""
    engine = DuckDBEngine(threads=1)
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    rows.append(_rows(0, 1000))
    stream = rows.stream(100)
    assert stream.next() is not None
    engine.close()
    stream.close()


def test_a_pinned_snapshot_is_hashed_where_it_is_stored(make_engine: MakeEngine) -> None:
    """A move's source hashes the snapshot it pins in DuckDB (its chunks then leave
    unhashed): the sum is that of the rows the stream hands out, hashed as Arrow by the
    target's side, whatever is appended after the pin."""
    engine = make_engine()
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    rows.append(_rows(0, 250_000))
    stream = rows.stream(100_000)
    rows.append(_rows(250_000, 1_000))  # after the pin: not in the snapshot
    pinned = stream.checksum()
    assert pinned is not None and pinned[0] == 250_000
    batches = []
    while (batch := stream.next()) is not None:
        batches.append(batch)
    assert engine.checksum_rows(pa.concat_tables(batches)) == pinned
    assert engine.checksum_rows(_rows(0, 250_000)) == pinned
    assert rows.stream(10).checksum() == engine.checksum_rows(_rows(0, 251_000))


def test_a_snapshot_is_hashed_whole_or_not_at_all(make_engine: MakeEngine) -> None:
    engine = make_engine()
    rows = engine.native_rows("t_1", _rows(0, 0).schema)
    rows.append(_rows(0, 1_000))
    stream = rows.stream(100)
    assert stream.next() is not None
    assert stream.checksum() is None  # reading began: the batches are hashed as they leave
    stream.close()
    closed = rows.stream(100)
    closed.close()
    assert closed.checksum() is None


def _scan_type(engine: DuckDBEngine, sql: str) -> str:
    plan = engine.run(f"EXPLAIN ANALYZE {sql}").column(1)[0].as_py()
    found = re.search(r"Type: (\w+ Scan)", plan)
    assert found is not None, plan
    return found.group(1)


def test_a_key_index_fetches_what_a_scan_finds_and_outlives_a_reset(
    make_engine: MakeEngine,
) -> None:
    """A shard with a key index looks one key up by the index and answers as the same rows
    without one do (the key repeats, lookups miss, other filters scan); a reset (a shard
    rebuilt from its files) keeps the index."""
    engine = make_engine()
    plain = engine.native_rows("t_plain", _rows(0, 0).schema)
    keyed = engine.native_rows("t_keyed", _rows(0, 0).schema, index="id")
    for rows in (plain, keyed):
        for first in (0, 50_000, 49_990):  # ten keys twice
            rows.append(_rows(first, 50_000 if first < 49_990 else 10))
        rows.compact()
    assert keyed.indexed() and not plain.indexed()
    lookup = "SELECT * FROM {} WHERE id = 49995"
    assert _scan_type(engine, lookup.format(keyed.ref)) == "Index Scan"
    assert _scan_type(engine, lookup.format(plain.ref)) == "Sequential Scan"
    for where in (
        "id = 49995",
        "id = 7",
        "id = -1",
        "id IN (1, 49999, 50000, 99999, 123456)",
        "id BETWEEN 10 AND 20",
        "tag = 'tag-3' AND id < 1000",
    ):
        answers = [
            sorted(engine.run(f"SELECT * FROM {r.ref} WHERE {where}").to_pylist(), key=repr)
            for r in (plain, keyed)
        ]
        assert answers[0] == answers[1], where
        assert answers[0] or where == "id = -1", where
    keyed.reset([_rows(0, 100)])
    assert keyed.indexed()
    assert _scan_type(engine, f"SELECT * FROM {keyed.ref} WHERE id = 42") == "Index Scan"
    assert engine.run(f"SELECT tag FROM {keyed.ref} WHERE id = 42").to_pylist() == [
        {"tag": "tag-2"}
    ]


def test_a_statement_runs_straight_to_arrow_and_answers_as_the_relation_does() -> None:
    """The engine runs a statement straight to Arrow (DuckDB's relation binds it twice):
    the pinned DuckDB has that path, and what it returns (types, names, empty results,
    registered inputs) and raises is what the relation returns and raises."""
    assert duckdb_engine.DIRECT_SUBMIT  # a DuckDB without it would quietly be slower
    con = duckdb.connect()
    inputs = _rows(0, 1000)

    def cursor() -> duckdb.DuckDBPyConnection:
        fresh = con.cursor()
        fresh.register("inputs", inputs)  # as a fragment's inputs are
        return fresh

    queries = [
        "SELECT id, tag FROM inputs WHERE id % 7 = 3 ORDER BY id",
        "SELECT * FROM inputs WHERE id < 0",
        "SELECT 1.25::DECIMAL(15, 2) AS d, DATE '1995-03-15' AS day, [1, 2] AS l, "
        "{'a': 1} AS s, NULL AS n, 'x' AS t, 1 AS a, 2 AS a",
        "SELECT tag, count(*) AS n, sum(id) AS s FROM inputs GROUP BY tag ORDER BY tag",
    ]
    for sql in queries:
        direct = duckdb_engine.as_arrow(cursor(), sql)
        relation = cursor().sql(sql).to_arrow_table()
        assert direct.schema == relation.schema and direct.equals(relation), sql
    for wrong in ("SELECT * FROM no_such_table", "SELECT nope FROM inputs", "SELEC 1"):
        with pytest.raises(duckdb.Error) as relation_error:
            cursor().sql(wrong).to_arrow_table()
        with pytest.raises(type(relation_error.value), match=re.escape(str(relation_error.value))):
            duckdb_engine.as_arrow(cursor(), wrong)
