"""Live moves without Ray: the migrator and the real worker halves of a move, in process.

The target's copy is compared with what the sources handed out at the fence; a copy that
misses a row or holds a changed value (the test-only fault hook) rolls the move back at
VERIFY, the source keeps serving every row, and a retry without the fault succeeds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from shardflow.catalog import name_key
from shardflow.control.admission import CopyPacer
from shardflow.control.migration import Checksum, MigrationState
from shardflow.errors import ClusterError, Moved, MoveRefusedError
from shardflow.runtime.protocol import NewTable
from shardflow.runtime.worker.moves import SourceSide, TargetSide
from shardflow.runtime.worker.node import WorkerNode
from tests.support.local_cluster import (
    CHECK,
    ROWS,
    LocalCluster,
    assert_serves,
    events,
    orders,
)


def last_move(cluster: LocalCluster) -> MigrationState:
    return cluster.controller.migrator.history[-1]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data")
    local.create_table("events", events(0, ROWS), "id")
    local.create_table("orders_e", orders(0, ROWS), "oid", colocate_with="events")
    yield local
    local.close()


def other_node(cluster: LocalCluster, node: str) -> str:
    return next(n for n in cluster.catalog.nodes if n != node)


def test_a_move_compares_what_was_handed_out_with_what_is_stored(cluster: LocalCluster) -> None:
    cluster.insert("events", events(ROWS, 500))
    unit = cluster.units("events")[0]
    to = other_node(cluster, unit.node)
    record = cluster.migrate(unit.unit_id, to)
    assert record["phase"] == "done", record["outcome"]
    assert cluster.catalog.group_of("events").unit(unit.unit_id).node == to
    state = last_move(cluster)
    [source] = state.handed_out
    assert source.node == unit.node
    assert set(state.stored) == {"events", "orders_e"}  # every co-located table is compared
    for table in ("events", "orders_e"):
        assert state.stored[table] == source.handed_out[table]
        assert state.stored[table].rows == source.held[table] > 0
    assert set(record["phase_seconds"]) >= {"fence", "verify", "switch"}
    # the pause is the source's hold (its fence to its retirement), within the coordinator's
    # span of the same steps, which is a call to the source and an answer longer
    span = sum(record["phase_seconds"][p] for p in ("fence", "verify", "switch"))
    assert 0 < record["fence_seconds"] < span
    assert_serves(cluster, pa.concat_tables([events(0, ROWS), events(ROWS, 500)]))
    assert cluster.moves_counted("move", "done") == 1


def held_compactions(cluster: LocalCluster) -> dict[str, int]:
    return {n: cluster.workers.get(n).node.engine.compactor.held for n in cluster.catalog.nodes}


def test_a_plain_move_opens_the_units_files_and_copies_no_row(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration ships storage: the target opens the unit's newest checkpoint file and
    replays the log after it (inserts logged since the last checkpoint included); the
    source hands out no chunk; VERIFY compares the file's record and the rows replayed."""
    unit = cluster.units("events")[0]
    cluster.insert("events", events(ROWS, 500))  # in the log, after the load's checkpoint
    chunks: list[int] = []
    chunk = SourceSide.chunk

    def counted(side: SourceSide, *args: Any) -> pa.Table | None:
        chunks.append(1)
        return chunk(side, *args)

    monkeypatch.setattr(SourceSide, "chunk", counted)
    to = other_node(cluster, unit.node)
    assert cluster.migrate(unit.unit_id, to)["phase"] == "done"
    assert chunks == []
    moved = cluster.workers.get(to).node.shards[("events", unit.unit_id)]
    assert moved.data.checkpoint_lsn == 0  # the load's file, where it lies
    assert moved.lsn > 0  # and the insert after it, replayed from the log
    cluster.insert("events", events(ROWS + 500, 500))  # the new owner logs on
    assert_serves(cluster, pa.concat_tables([events(0, ROWS + 1000)]))


def test_a_checkpoint_written_after_the_pin_is_counted_as_handed_out(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source checkpoints the shard between its pin and the target's opening of the
    files (inserts go on): the target opens the newer checkpoint, and the inserts between
    the pin and it count as handed out. They were left out once, and VERIFY rolled back a
    sound move (seen under an inserter with frequent checkpoints)."""
    unit = cluster.units("events")[0]
    key = ("events", unit.unit_id)
    source = cluster.workers.get(unit.node).node
    pin = SourceSide.pin
    later: list[pa.Table] = []

    def pin_then_checkpoint(side: SourceSide, plan: Any) -> Any:
        pinned = pin(side, plan)
        for start in (2_000_000, 3_000_000):  # some of each lands on the pinned shard
            later.append(events(start, 300))
            cluster.insert("events", later[-1])
            if start == 2_000_000:  # a checkpoint newer than the pin, an insert after it
                source.shards[key].checkpoint()
        return pinned

    monkeypatch.setattr(SourceSide, "pin", pin_then_checkpoint)
    to = other_node(cluster, unit.node)
    pinned_at = source.shards[key].lsn
    record = cluster.migrate(unit.unit_id, to)
    assert record["phase"] == "done", record["outcome"]
    moved = cluster.workers.get(to).node.shards[key]
    checkpoint = moved.data.checkpoint_lsn
    assert checkpoint is not None and checkpoint > pinned_at  # the newer file was opened
    state = last_move(cluster)
    handed_out = sum((s.handed_out["events"] for s in state.handed_out), Checksum())
    assert state.stored["events"] == handed_out
    assert_serves(cluster, pa.concat_tables([events(0, ROWS), *later]))


def test_compaction_waits_while_a_copy_is_built_and_runs_after(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's engine does not compress rows while it builds a split's copy (the
    copy's appends and its fence would wait for it); once the split is done, or rolled
    back, it may again. Loads hold it the same way while they stage."""
    assert set(held_compactions(cluster).values()) == {0}  # the loads released theirs
    unit = cluster.units("events")[0]
    seen: list[dict[str, int]] = []
    catch_up = TargetSide.catch_up

    def watched(side: TargetSide, *args: Any) -> int:
        seen.append(held_compactions(cluster))
        return catch_up(side, *args)

    monkeypatch.setattr(TargetSide, "catch_up", watched)
    assert cluster.split(unit.unit_id)["phase"] == "done"
    targets = {t.node for t in last_move(cluster).plan.targets}
    assert seen and all(held[n] == 1 for held in seen for n in targets)
    # the copy's rows went into a checkpoint file of each new shard (written compressed)
    for target in last_move(cluster).plan.targets:
        node = cluster.workers.get(target.node).node
        assert node.shards[("events", target.unit_id)].data.checkpoint_lsn == 0
    assert set(held_compactions(cluster).values()) == {0}


def test_a_copy_is_paced_by_how_much_the_targets_own_work_slows_down(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes learn how long their fragments and inserts usually take; a move's copy asks
    its target after every chunk how much slower they run now, and waits as the pacer
    says (``control/admission.py``)."""
    for number in range(3):
        cluster.insert("events", events(ROWS + 100 * number, 100))
        cluster.sql(CHECK)
    kinds = {
        kind
        for node in cluster.catalog.nodes
        for kind in cluster.workers.get(node).node.foreground.usual
    }
    assert any(k.startswith("insert events") for k in kinds), kinds
    assert any("sum(events.id)" in k.lower() for k in kinds), kinds
    asked: list[tuple[int, float]] = []
    after_chunk = CopyPacer.after_chunk

    def spied(pacer: CopyPacer, nbytes: int, seconds: float, slowdown: float) -> float:
        asked.append((nbytes, slowdown))
        return after_chunk(pacer, nbytes, seconds, slowdown)

    monkeypatch.setattr(CopyPacer, "after_chunk", spied)
    monkeypatch.setattr(WorkerNode, "foreground_slowdown", lambda node: 3.0)
    unit = cluster.units("events")[0]
    assert cluster.split(unit.unit_id)["phase"] == "done"  # a split copies rows
    assert asked and all(nbytes > 0 and slowdown == 3.0 for nbytes, slowdown in asked)
    assert_serves(cluster, pa.concat_tables([events(0, ROWS + 300)]))


def test_a_source_does_not_learn_its_slowdown_during_a_move_as_usual(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handing out a move's rows slows the source's own work too (on its cores, under its
    locks); learned as its usual latency, the slowdown would stop pacing the next copy it
    takes in. Here the source's fragments run five times slower while it hands out chunks:
    its usual latency stays what it was, and it reads as a slowdown."""
    unit = cluster.units("events")[0]
    source = cluster.workers.get(unit.node).node
    source.record_foreground("probe", 0.010)
    chunk = SourceSide.chunk
    handed_out = []

    def slowed(side: SourceSide, *args: Any) -> pa.Table | None:
        if side.node is source:
            handed_out.append(1)
            source.record_foreground("probe", 0.050)
        return chunk(side, *args)

    monkeypatch.setattr(SourceSide, "chunk", slowed)
    assert cluster.split(unit.unit_id)["phase"] == "done"  # a split hands out rows
    assert handed_out
    assert source.foreground.usual["probe"] == pytest.approx(0.010)
    assert source.foreground_slowdown() == pytest.approx(5.0)
    source.record_foreground("probe", 0.020)  # the move is over: learned again
    assert source.foreground.usual["probe"] == pytest.approx(0.011)


def test_the_balancer_knows_how_long_moves_take_now(cluster: LocalCluster) -> None:
    assert cluster.controller.move_s_per_byte() == 0.0  # no move yet
    unit = cluster.units("events")[0]
    record = cluster.migrate(unit.unit_id, other_node(cluster, unit.node))
    assert record["phase"] == "done"
    state = last_move(cluster)
    assert state.finished_at is not None
    took = (state.finished_at - state.started_at) / state.copied_bytes
    assert cluster.controller.move_s_per_byte() == pytest.approx(took)


def test_a_table_loaded_into_units_split_under_it_is_not_created(cluster: LocalCluster) -> None:
    """Splits and merges are refused while a table is loaded into their group; should one
    get past that (here: the load hidden from the refusal on purpose), the create is
    refused at its commit, its files removed, rather than lose the split unit's rows."""
    state = cluster.state
    schema = orders(0, 1).schema.serialize().to_pybytes()
    state.begin_create(NewTable("beside", schema, "distributed", "oid", "events"))
    unit = cluster.units("events")[0].unit_id
    with pytest.raises(MoveRefusedError, match="beside"):
        cluster.split(unit)
    hidden = state.pending.pop(name_key("beside"))
    assert cluster.split(unit)["phase"] == "done"
    state.pending[name_key("beside")] = hidden
    with pytest.raises(ClusterError, match="split or merged meanwhile"):
        state.commit_create("beside", 0)
    state.abort_create("beside")
    assert cluster.catalog.find_table("beside") is None and not state.pending
    cluster.create_table("beside", orders(0, ROWS), "oid", colocate_with="events")
    assert cluster.sql("SELECT count(*) AS n FROM beside").to_pylist() == [{"n": ROWS}]


def test_inserts_made_during_a_move_arrive_and_are_counted(cluster: LocalCluster) -> None:
    unit = cluster.units("events")[0]
    stop = threading.Event()
    inserted: list[pa.Table] = []
    failures: list[BaseException] = []

    def write() -> None:
        start = 1_000_000
        while not stop.is_set():
            batch = events(start, 50)
            try:
                cluster.insert("events", batch)
                inserted.append(batch)
            except BaseException as error:  # reported below
                failures.append(error)
                return
            start += 50

    writer = threading.Thread(target=write)
    writer.start()
    try:
        record = cluster.migrate(unit.unit_id, other_node(cluster, unit.node))
        split = cluster.split(unit.unit_id)
        halves = [t.unit_id for t in last_move(cluster).plan.targets]
        merged = cluster.merge(halves[0], halves[1])
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not failures, failures
    assert [record["phase"], split["phase"], merged["phase"]] == ["done"] * 3, (
        record["outcome"],
        split["outcome"],
        merged["outcome"],
    )
    for state in cluster.controller.migrator.history:
        handed_out = sum((s.handed_out["events"] for s in state.handed_out), Checksum())
        assert state.stored["events"] == handed_out
    assert_serves(cluster, pa.concat_tables([events(0, ROWS), *inserted]))


@pytest.mark.parametrize("kind", ["move", "split"])
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("drop_row", "the sources handed out"),
        ("change_value", "checksums differ"),
    ],
)
def test_a_corrupted_copy_rolls_back_at_verify(
    tmp_path: Path, kind: str, fault: str, named: str
) -> None:
    cluster = LocalCluster(tmp_path / "data", test_fault_move_copy=fault)
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        cluster.create_table("orders_e", orders(0, ROWS), "oid", colocate_with="events")
        unit = cluster.units("events")[0]
        target = other_node(cluster, unit.node) if kind == "move" else unit.node
        target_side = cluster.workers.get(target).node.target
        served_before = set(target_side.node.shards)
        final: list[tuple[bool, set[object]]] = []  # what the target did at the fence
        apply_final = target_side.apply_final

        def watched(move_id: str, fenced: Any) -> Any:
            answer = apply_final(move_id, fenced)
            final.append((answer.promoted, set(target_side.node.shards)))
            return answer

        target_side.apply_final = watched  # type: ignore[method-assign]

        def attempt() -> dict[str, object]:
            if kind == "move":
                return cluster.migrate(unit.unit_id, target)
            return cluster.split(unit.unit_id)

        record = attempt()
        assert record["phase"] == "rolled_back"
        assert "verification" in str(record["outcome"]) and named in str(record["outcome"])
        assert "verify" in record["phase_seconds"]  # it got as far as VERIFY, and no further
        assert "switch" not in record["phase_seconds"]
        assert final == [(False, served_before)], "the target served a copy that differs"
        # the source still owns and serves every row, and takes writes again
        assert cluster.catalog.group_of("events").unit(unit.unit_id).node == unit.node
        assert_serves(cluster, events(0, ROWS))
        cluster.insert("events", events(ROWS, 100))
        everything = pa.concat_tables([events(0, ROWS), events(ROWS, 100)])
        assert_serves(cluster, everything)
        # the history and the Prometheus counter have it, with the reason
        [kept] = cluster.controller.history()
        assert kept["phase"] == "rolled_back" and named in kept["outcome"]
        assert cluster.moves_counted(kind, "rolled_back") == 1
        assert cluster.moves_counted(kind, "done") == 0
        assert not cluster.workers.get(target).node.target.imports  # the copy was dropped
        assert set(held_compactions(cluster).values()) == {0}

        # with the fault off, the same move goes through and every row is there
        cluster.restart(target, test_fault_move_copy="")
        record = attempt()
        assert record["phase"] == "done", record["outcome"]
        assert_serves(cluster, everything)
        assert cluster.moves_counted(kind, "done") == 1
    finally:
        cluster.close()


def test_a_move_to_a_worker_that_is_gone_rolls_back(cluster: LocalCluster) -> None:
    unit = cluster.units("events")[0]
    target = other_node(cluster, unit.node)
    held = sum(u.node == target for u in cluster.units("events"))
    cluster.workers.stop(target)
    record = cluster.migrate(unit.unit_id, target)
    assert record["phase"] == "rolled_back" and "WorkerGone" in str(record["outcome"])
    assert cluster.catalog.group_of("events").unit(unit.unit_id).node == unit.node
    # the controller fails the dead worker over: its units are rebuilt from their files
    failover = cluster.controller.fail_node(target)
    assert failover is not None and failover.units == held > 0
    assert target not in cluster.catalog.nodes
    assert_serves(cluster, events(0, ROWS))


def test_a_move_whose_source_fails_over_onto_its_target_rolls_back_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source dies during the move and the failover gives its units to the move's
    target (here the only other node): the catalog syncs left the moving unit to the copy
    being built; when the move rolls back, the target serves the unit from its files."""
    cluster = LocalCluster(tmp_path / "data", nodes=2)
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        unit = cluster.units("events")[0]
        source, target = unit.node, other_node(cluster, unit.node)
        catch_up = TargetSide.catch_up

        def source_dies(side: TargetSide, *args: Any) -> int:
            if source in cluster.catalog.nodes:
                cluster.workers.stop(source)
                cluster.controller.fail_node(source)
            return catch_up(side, *args)

        monkeypatch.setattr(TargetSide, "catch_up", source_dies)
        record = cluster.migrate(unit.unit_id, target)
        assert record["phase"] == "rolled_back", record["outcome"]
        assert list(cluster.catalog.nodes) == [target]
        assert cluster.catalog.group_of("events").unit(unit.unit_id).node == target
        assert_serves(cluster, events(0, ROWS))
    finally:
        cluster.close()


def test_a_shard_the_catalog_takes_away_refuses_appends_and_outlives_its_readers(
    cluster: LocalCluster,
) -> None:
    """An insert routed before a catalog change may still hold the shard the change takes
    away: it is told ``Moved`` (and re-routed), never left writing into a dropped table;
    a fragment bound to the shard before the change reads it to the end."""
    unit = cluster.units("events")[0]
    node = cluster.workers.get(unit.node).node
    key = ("events", unit.unit_id)
    shard = node.shards[key]
    rows_before = shard.data.read().num_rows
    node.readers[key] += 1  # a fragment is reading the shard
    node.sync(cluster.catalog.without_table("events").to_json())
    assert key not in node.shards
    with pytest.raises(Moved):
        shard.append(events(ROWS, 10), "late-batch")
    assert shard.data.read().num_rows == rows_before  # still there for the reader
    node.readers[key] -= 1
    node._release_unread()
    with pytest.raises(duckdb.CatalogException):
        shard.data.read()  # released once the reader finished


def test_a_unit_moved_back_while_its_old_copy_is_read_keeps_a_database_of_its_own(
    cluster: LocalCluster,
) -> None:
    """A unit moves away from a node while a fragment there still reads it, then moves
    back: the node holds two copies of the same unit at the same commit. The move's
    cleanup does not wait for the reader (the old copy is released when it finishes), and
    releasing the old copy leaves the new one's rows: each copy has an in-memory database
    of its own (sharing one by name, the release dropped the served copy's rows)."""
    unit = cluster.units("events")[0]
    home = unit.node
    node = cluster.workers.get(home).node
    key = ("events", unit.unit_id)
    with node.lock:
        node.readers[key] += 1  # a fragment bound to the unit before the move, still reading
    started = time.monotonic()
    assert cluster.migrate(unit.unit_id, other_node(cluster, home))["phase"] == "done"
    assert cluster.migrate(unit.unit_id, home)["phase"] == "done"
    assert time.monotonic() - started < 30  # the cleanups did not wait for the reader
    assert [shard for k, shard, _ in node._releasing if k == key]  # kept while read
    cluster.insert("events", events(ROWS, 300))
    with node.lock:
        node.readers[key] -= 1  # the reader finishes: the old copy is released
        node._release_unread()
    assert not node._releasing
    assert cluster.catalog.group_of("events").unit(unit.unit_id).node == home
    assert_serves(cluster, events(0, ROWS + 300))
    cluster.insert("events", events(ROWS + 300, 200))
    assert_serves(cluster, events(0, ROWS + 500))
