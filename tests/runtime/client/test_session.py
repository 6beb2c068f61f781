"""The session without Ray: the real ``Session`` over the in-process coordinator and workers
(real DuckDB, real files), speaking to both through the protocol only. Its answers are
checked against DuckDB over the same rows; its routing goes stale under moves, splits, a
failover, and it retries as it does on Ray."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from shardflow.errors import (
    ClosedError,
    MoveRefusedError,
    QueryError,
    SqlSyntaxError,
    TableExistsError,
    UnknownShardError,
    UnknownTableError,
)
from shardflow.runtime.client.session import Session
from shardflow.runtime.inprocess import LocalBackend, LocalCoordinator, LocalWorkers
from shardflow.runtime.query import planning
from shardflow.runtime.query.fragments import WorkerCalls
from shardflow.sql.plan import WHOLE
from tests.support.local_cluster import ROWS, LocalCluster, events, orders

NATIONS = pa.table({"nid": pa.array(range(7), pa.int64()), "name": [f"n{i}" for i in range(7)]})

QUERIES = (
    "SELECT count(*) AS n, sum(id) AS s FROM events",
    "SELECT id % 7 AS k, count(*) AS n, max(pad) AS p FROM events GROUP BY k ORDER BY k",
    "SELECT e.id % 5 AS k, sum(o.amount) AS a FROM events e JOIN orders_e o ON e.id = o.oid "
    "GROUP BY k ORDER BY k",
    "SELECT n.name, count(*) AS c FROM events e JOIN nations n ON e.id % 7 = n.nid "
    "GROUP BY n.name ORDER BY n.name",
    "SELECT id, pad FROM events ORDER BY id DESC LIMIT 5",
    "SELECT count(DISTINCT id % 1000) AS d FROM events WHERE id > 100",
    "SELECT * FROM events WHERE id = 4242",
)


def oracle(tables: dict[str, pa.Table], query: str) -> list[dict[str, object]]:
    con = duckdb.connect()
    try:
        for name, rows in tables.items():
            con.register(name, rows)
        return con.sql(query).to_arrow_table().to_pylist()
    finally:
        con.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data")
    local.session.create_table("events", events(0, ROWS), "id", False, None)
    local.session.create_table("orders_e", orders(0, ROWS), "oid", False, "events")
    local.session.create_table("nations", NATIONS, None, True, None)
    yield local
    local.close()


def rows_of(cluster: LocalCluster) -> dict[str, pa.Table]:
    return {"events": events(0, ROWS), "orders_e": orders(0, ROWS), "nations": NATIONS}


def test_the_session_runs_on_the_in_process_backend_through_the_protocol(
    cluster: LocalCluster,
) -> None:
    backend = cluster.backend
    assert isinstance(backend, LocalBackend)
    assert isinstance(cluster.session.coordinator, LocalCoordinator)
    assert isinstance(cluster.session.workers, LocalWorkers)
    assert isinstance(backend.fragment_calls(), WorkerCalls)
    for query in QUERIES:
        answer, report = cluster.session.query(query)
        assert answer.to_pylist() == oracle(rows_of(cluster), query), query
        assert report.stages, query


def test_a_stale_routing_snapshot_is_refreshed_and_the_work_retried(
    cluster: LocalCluster,
) -> None:
    session = cluster.session
    stale = session.catalog
    [first, *_] = cluster.units("events")
    target = next(n for n in cluster.catalog.nodes if n != first.node)
    # moved and split behind the session's back: another client's doing
    assert cluster.backend.node.migrate(first.unit_id, target)["phase"] == "done"
    [second, *_] = [u for u in cluster.units("events") if u.unit_id != first.unit_id]
    assert cluster.backend.node.split(second.unit_id)["phase"] == "done"
    assert session.catalog is stale and stale.epoch < cluster.catalog.epoch
    session.insert("events", events(ROWS, 300))  # told Moved, routed again: lands once
    query = QUERIES[0]
    answer, _ = session.query(query)
    assert answer.to_pylist() == oracle({"events": events(0, ROWS + 300)}, query)
    assert session.catalog.epoch == cluster.catalog.epoch


def test_a_failed_over_worker_is_seen_gone_and_its_shards_served_elsewhere(
    cluster: LocalCluster,
) -> None:
    gone = cluster.units("events")[0].node
    cluster.workers.stop(gone)  # a dead worker answers WorkerGone from now on
    cluster.controller.fail_node(gone)  # what the watch loop does
    for query in QUERIES[:3]:
        answer, _ = cluster.session.query(query)
        assert answer.to_pylist() == oracle(rows_of(cluster), query), query
    assert gone not in cluster.session.catalog.nodes


@pytest.mark.parametrize("replicated", [False, True])
def test_a_catalog_told_before_a_load_is_finished_serves_the_loads_own_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replicated: bool
) -> None:
    """A node is sent the catalog with a new table (another change's announce, or the
    coordinator catching it up) after its part of the load was committed and before the
    session's ``finish_load``: it serves the load's own shards then. Were it to take them
    from storage again, their claim would fence the load's copies that ``finish_load``
    serves next, and every insert would be told ``Moved`` until the deadline."""
    local = LocalCluster(tmp_path / "data", retry_deadline_s=5)
    try:
        node = local.catalog.nodes[0]
        worker = local.workers.get(node)
        finish = worker.finish_load

        def told_first(table: str) -> Any:
            worker.sync(local.state.catalog_json()).get()  # the catalog, then the session's
            return finish(table)

        monkeypatch.setattr(worker, "finish_load", told_first)
        if replicated:
            local.session.create_table("events", events(0, ROWS), None, True, None)
        else:
            local.session.create_table("events", events(0, ROWS), "id", False, None)
        local.insert("events", events(ROWS, 100))
        answer = local.sql("SELECT count(*) AS n FROM events").to_pylist()
        assert answer == [{"n": ROWS + 100}]
    finally:
        local.close()


def test_nodes_join_and_leave_through_the_session(cluster: LocalCluster) -> None:
    session = cluster.session
    node = session.add_node()  # started, admitted (calibrated), joined
    assert node in cluster.catalog.nodes and node in cluster.state.profiles
    [unit, *_] = cluster.units("events")
    assert session.migrate(unit.unit_id, node)["phase"] == "done"
    assert session.worker_infos()[node] is not None
    report = session.drain(node, deadline_s=60)
    assert report.drained and node not in cluster.catalog.nodes
    assert not cluster.workers._workers.get(node), "a drained worker is stopped"
    answer, _ = session.query(QUERIES[2])
    assert answer.to_pylist() == oracle(rows_of(cluster), QUERIES[2])


def test_tables_are_dropped_and_errors_are_the_coordinators_own(cluster: LocalCluster) -> None:
    session = cluster.session
    with pytest.raises(TableExistsError):
        session.create_table("EVENTS", events(0, 10), "id", False, None)
    with pytest.raises(SqlSyntaxError):
        session.query("SELEC 1")
    unit = cluster.units("events")[0].unit_id
    with pytest.raises(MoveRefusedError, match="not adjacent"):
        session.merge(unit, unit)
    with pytest.raises(UnknownShardError, match="replicated"):
        session.unit_of("nations#0")
    uid = cluster.catalog.table("orders_e").uid
    assert (Path(cluster.data_dir) / "tables" / uid).is_dir()
    session.drop_table("orders_e")
    assert "orders_e" not in cluster.catalog.tables
    assert not (Path(cluster.data_dir) / "tables" / uid).exists()
    with pytest.raises(UnknownTableError):
        session.insert("orders_e", orders(0, 1))


def test_closing_the_session_ends_a_call_that_is_retrying(cluster: LocalCluster) -> None:
    session: Session = cluster.session
    session.query(QUERIES[0])  # planned: the retry below is all that is left
    for node in list(cluster.catalog.nodes):
        cluster.workers.stop(node)  # nothing answers: it would retry for 30 s
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            session.query(QUERIES[0])
        except BaseException as error:
            outcome.append(error)

    caller = threading.Thread(target=run)
    started = time.monotonic()
    caller.start()
    time.sleep(0.3)
    session.close()
    caller.join(10)
    assert not caller.is_alive()
    assert [type(e) for e in outcome] == [ClosedError], outcome
    assert time.monotonic() - started < session.settings.retry_deadline_s


def test_plans_outlive_moves_splits_and_merges_not_new_tables(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan names no node: the queries after a move, a split or a merge are bound to the
    plans made before (not planned again), and still answer right. A table the session
    starts to use, or a group gathered onto one node (its queries then run whole there), is
    planned anew; a table made elsewhere that it does not use changes nothing."""
    for query in QUERIES * 2:  # the first round learns the tables' routing one by one
        cluster.session.query(query)
    planned: list[str] = []
    real = planning.plan_query

    def counting(sql: str, *args: object) -> object:
        planned.append(sql)
        return real(sql, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(planning, "plan_query", counting)
    first, second, *_ = cluster.units("events")
    target = next(n for n in cluster.catalog.nodes if n not in (first.node, second.node))
    assert cluster.migrate(first.unit_id, target)["phase"] == "done"
    assert cluster.split(second.unit_id)["phase"] == "done"
    for query in QUERIES:
        answer, _ = cluster.session.query(query)
        assert answer.to_pylist() == oracle(rows_of(cluster), query), query
    assert planned == [], "queries were planned again after a move and a split"

    other = Session(cluster.backend)  # another client makes a table
    other.create_table("more", NATIONS, None, True, None)
    other.close()
    for query in QUERIES:
        cluster.session.query(query)
    assert planned == [], "a table the session does not use changed its plans"
    cluster.session.query("SELECT count(*) FROM more")
    planned.clear()
    for query in QUERIES:
        cluster.session.query(query)
    assert planned == list(QUERIES)
    planned.clear()
    for unit in cluster.units("events"):  # every unit onto one node
        if unit.node != target:
            assert cluster.migrate(unit.unit_id, target)["phase"] == "done"
    answer, report = cluster.session.query(QUERIES[2])
    assert planned == [QUERIES[2]]
    assert [s.strategy for s in report.stages] == [WHOLE]
    assert answer.to_pylist() == oracle(rows_of(cluster), QUERIES[2])


def spy_on_routing(session: Session) -> list[tuple[list[str] | None, int]]:
    """What ``session`` asks the coordinator for from now on: the tables (None: the catalog
    whole) and the tables answered."""
    asked: list[tuple[list[str] | None, int]] = []
    original = session.coordinator.catalog

    def spy(tables: Any = None) -> Any:
        reply = original(tables)
        asked.append((None if tables is None else list(tables), len(reply.get()["tables"])))
        return reply

    coordinator = session.coordinator
    calls = {n: getattr(coordinator, n) for n in dir(coordinator) if not n.startswith("_")}
    session.coordinator = SimpleNamespace(**{**calls, "catalog": spy})  # type: ignore[assignment]
    return asked


def test_a_session_fetches_the_routing_of_the_tables_it_uses_only(
    cluster: LocalCluster,
) -> None:
    """A new session knows no table; each query or insert fetches the routing of a table
    it names the first time; a ``Moved`` refreshes those tables only, however many the
    cluster has; answers stay DuckDB's."""
    for index in range(6):  # tables this session never uses
        cluster.session.create_table(f"other_{index}", events(0, 50), "id", False, None)
    session = Session(cluster.backend)
    try:
        assert dict(session.catalog.tables) == {} and session.catalog.nodes
        asked = spy_on_routing(session)
        query = QUERIES[2]  # events joined with orders_e
        assert session.query(query)[0].to_pylist() == oracle(rows_of(cluster), query)
        assert sorted(session.catalog.tables) == ["events", "orders_e"]
        assert asked and all(t is not None and len(t) <= 2 for t, _ in asked)
        session.insert("nations", NATIONS.slice(0, 1).set_column(0, "nid", pa.array([99])))
        assert sorted(session.catalog.tables) == ["events", "nations", "orders_e"]
        # moved behind the session's back: the next query is told Moved and refreshes
        [unit, *_] = cluster.units("events")
        target = next(n for n in cluster.catalog.nodes if n != unit.node)
        assert cluster.backend.node.migrate(unit.unit_id, target)["phase"] == "done"
        asked.clear()
        assert session.query(QUERIES[0])[0].to_pylist() == oracle(rows_of(cluster), QUERIES[0])
        assert session.catalog.epoch == cluster.catalog.epoch
        assert asked and all(t is not None and answered <= 3 for t, answered in asked), asked
        assert len(cluster.catalog.tables) == 9
    finally:
        session.close()


def test_tables_made_or_dropped_elsewhere_are_found_and_unknown_ones_named_in_full(
    cluster: LocalCluster,
) -> None:
    session = Session(cluster.backend)
    try:
        assert session.query("SELECT count(*) AS n FROM events")[0].to_pylist() == [{"n": ROWS}]
        cluster.session.create_table("late", events(0, 40), "id", False, None)
        answer = session.query("SELECT count(*) AS n FROM late JOIN events USING (id)")[0]
        assert answer.to_pylist() == [{"n": 40}]
        with pytest.raises(UnknownTableError) as raised:
            session.query("SELECT * FROM nope")
        # every table of the cluster is named, not only the ones this session routes
        assert "(tables: events, late, nations, orders_e)" in str(raised.value)
        with pytest.raises(UnknownTableError, match="nations"):
            session.table_spec("nope")
        cluster.session.drop_table("late")
        with pytest.raises(QueryError, match="dropped while it ran"):  # routed as it was
            session.query("SELECT count(*) FROM late")
        with pytest.raises(UnknownTableError):  # and now known to be gone
            session.query("SELECT count(*) FROM late")
        # a query DuckDB reads but shardflow's parser does not still finds its table
        answer = session.query("FROM nations SELECT count(*) AS n")[0]
        assert answer.to_pylist() == [{"n": NATIONS.num_rows}]
    finally:
        session.close()


def test_a_unit_is_split_far_finer_than_the_old_bucket_count(cluster: LocalCluster) -> None:
    """Buckets are fine-grained from the start (2^30): one unit split ten times over holds
    a 3,000th of the key space, finer than the 256 buckets of before allowed, and inserts
    (one sent twice) and queries stay exact."""
    assert cluster.catalog.n_buckets == 1 << 30
    lowest = min(cluster.units("events"), key=lambda u: u.lo)
    for _ in range(10):
        assert cluster.split(lowest.unit_id)["phase"] == "done"
        lowest = min(cluster.units("events"), key=lambda u: u.lo)
    assert lowest.hi - lowest.lo < (1 << 30) // 3000
    more = events(ROWS, 500)
    cluster.insert("events", more, batch_id="twice")
    cluster.insert("events", more, batch_id="twice")
    tables = {**rows_of(cluster), "events": pa.concat_tables([events(0, ROWS), more])}
    for query in QUERIES:
        assert cluster.sql(query).to_pylist() == oracle(tables, query), query
