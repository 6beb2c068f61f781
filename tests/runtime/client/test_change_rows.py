"""DELETE and UPDATE across shards, all or nothing: every shard prepares its part durably
without putting it in effect, the coordinator logs the decision in the catalog, then every
node puts its parts in effect. In process: real workers, DuckDB and files on three nodes;
DuckDB on the same rows is the oracle. ``SHARDFLOW_TEST_UNFENCED=atomic`` makes the
coordinator commit what was prepared though a part failed, and the atomicity test must then
fail."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from shardflow.control import balancer
from shardflow.errors import ClusterError, QueryError, UnsupportedError
from shardflow.runtime.client import changes as changes_module
from shardflow.runtime.coordinator import node as node_module
from shardflow.runtime.inprocess import Answered
from shardflow.sql.statements import ChangeRows, statement_of
from shardflow.storage import RowRewrite
from tests.support.local_cluster import LocalCluster

ROWS = 3_000
SUMMARY = (
    "SELECT count(*) AS n, sum(id) AS ids, sum(n) AS ns, "
    "string_agg(name, ',' ORDER BY id) AS names FROM t"
)


def rows(start: int, count: int) -> pa.Table:
    ids = list(range(start, start + count))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"r{i}" for i in ids]),
            "n": pa.array([i % 97 for i in ids], pa.int64()),
        }
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path / "data", nodes=3)
    made.create_table("t", rows(0, ROWS), "id")
    assert len({u.node for u in made.units("t")}) == 3, "the test needs shards on every node"
    yield made
    made.close()


def oracle() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    data = rows(0, ROWS)  # noqa: F841 (read by DuckDB by name)
    con.execute("CREATE TABLE t AS SELECT * FROM data")
    return con


def change(cluster: LocalCluster, sql: str, statement: str | None = None) -> int:
    parsed = statement_of(sql)
    assert isinstance(parsed, ChangeRows)
    return cluster.session.change_rows(parsed, statement)[0]


def summary(cluster: LocalCluster) -> list[dict[str, object]]:
    return cluster.sql(SUMMARY).to_pylist()


def changes_as_duckdb(cluster: LocalCluster, con: duckdb.DuckDBPyConnection, sql: str) -> int:
    """Run ``sql`` on both sides: as many rows changed, and the table the same after."""
    expected = int(con.execute(sql).fetchall()[0][0])
    assert change(cluster, sql) == expected, sql
    assert summary(cluster) == con.sql(SUMMARY).to_arrow_table().to_pylist(), sql
    return expected


def test_deletes_and_updates_answer_as_duckdb_does(cluster: LocalCluster) -> None:
    con = oracle()
    first = cluster.catalog.table("t").commit
    statements = [
        "DELETE FROM t WHERE id % 7 = 3",
        "UPDATE t SET n = n * 10 + 1, name = upper(name) WHERE id BETWEEN 100 AND 1200",
        "DELETE FROM t AS x WHERE x.n > 900 OR x.name LIKE 'r29%'",
        "UPDATE t SET name = NULL WHERE id % 11 = 0",
        "DELETE FROM t WHERE name IS NULL AND id > 2500",
        "UPDATE t SET n = 0",
        "DELETE FROM t WHERE id < 0",
    ]
    for sql in statements:
        changes_as_duckdb(cluster, con, sql)
    assert cluster.catalog.table("t").commit == first + len(statements) - 1  # a change of no row
    # is no commit


def test_a_change_is_kept_across_restarts_and_checkpoints(cluster: LocalCluster) -> None:
    change(cluster, "DELETE FROM t WHERE id % 2 = 0")
    change(cluster, "UPDATE t SET n = -1 WHERE id < 100")
    cluster.insert("t", rows(ROWS, 10))
    before = summary(cluster)
    for node in sorted({u.node for u in cluster.units("t")}):
        cluster.restart(node)
    assert summary(cluster) == before
    for node in sorted({u.node for u in cluster.units("t")}):
        for shard in cluster.workers.get(node).node.shards.values():
            shard.checkpoint()
        cluster.restart(node)
    assert summary(cluster) == before


def test_a_statement_tried_again_with_its_id_is_applied_once(cluster: LocalCluster) -> None:
    assert change(cluster, "UPDATE t SET n = n + 1 WHERE id < 10", "s-1") == 10
    assert change(cluster, "UPDATE t SET n = n + 1 WHERE id < 10", "s-1") == 10
    assert cluster.sql("SELECT sum(n) AS s FROM t WHERE id < 10").to_pylist() == [
        {"s": sum(i % 97 + 1 for i in range(10))}
    ]


def returning(
    cluster: LocalCluster, sql: str, statement: str | None = None
) -> tuple[int, pa.Table]:
    parsed = statement_of(sql)
    assert isinstance(parsed, ChangeRows) and parsed.returning is not None
    count, returned = cluster.session.change_rows(parsed, statement)
    assert returned is not None
    return count, returned


def test_returning_gives_back_the_changed_rows_as_duckdb_does(cluster: LocalCluster) -> None:
    """``RETURNING``: a deleted row as it was, an updated one as it is left (an UPDATE of
    the key among them), from every shard the statement changed, values and types as
    DuckDB's own RETURNING gives them (the names of unnamed expressions aside: DuckDB
    spells the casts it adds)."""
    con = oracle()
    for sql in (
        "DELETE FROM t WHERE id % 7 = 3 RETURNING *",
        "UPDATE t AS x SET n = n * 10 + 1, name = upper(name) WHERE id BETWEEN 100 AND 1200 "
        "RETURNING id, x.n AS w, name || '!' AS loud",
        "UPDATE t SET id = id + 100000 WHERE id < 40 RETURNING id, n",  # rows move shards
        "UPDATE t SET n = (SELECT count(*) FROM t AS u WHERE u.n = t.n) WHERE id < 90 "
        "RETURNING id, n",  # correlated: every shard reads a copy of t
        "DELETE FROM t WHERE id IN (SELECT id FROM t WHERE n = 5) RETURNING n * 2 AS twice",
        "DELETE FROM t WHERE id < 0 RETURNING *",  # nothing: no rows, the columns
    ):
        theirs = con.execute(sql)
        names = [d[0] for d in theirs.description]
        expected = theirs.fetchall()
        count, got = returning(cluster, sql)
        assert count == len(expected) == got.num_rows, sql
        assert got.num_columns == len(names), sql
        assert [n for n in got.column_names if not n.startswith("(")] == [
            n for n in names if not n.startswith("(")
        ], sql
        ours = [tuple(row.values()) for row in got.to_pylist()]
        assert sorted(ours, key=repr) == sorted(expected, key=repr), sql
        assert summary(cluster) == con.sql(SUMMARY).to_arrow_table().to_pylist(), sql
    _, none = returning(cluster, "DELETE FROM t WHERE id < 0 RETURNING *")
    assert none.num_rows == 0 and none.schema.types == rows(0, 1).schema.types
    # a volatile value: what is returned is what is stored (evaluated once)
    _, tokens = returning(cluster, "UPDATE t SET name = uuid()::VARCHAR WHERE id < 60 RETURNING *")
    assert tokens.num_rows > 10
    stored = cluster.sql("SELECT id, name FROM t WHERE id < 60").to_pylist()
    assert sorted(stored, key=repr) == sorted(tokens.select(["id", "name"]).to_pylist(), key=repr)


def test_a_statement_with_returning_tried_again_gives_back_the_same_rows(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried again with its id, a statement with ``RETURNING`` is applied once and gives
    back what it gave the first time; where the coordinator no longer holds that (a new
    coordinator), it says so, and still applies nothing again."""
    sql = "UPDATE t SET n = n + 1 WHERE id < 10 RETURNING id, n"
    first = returning(cluster, sql, "r-1")
    assert first[0] == 10
    assert returning(cluster, sql, "r-1") == first
    cluster.backend.node._returned.clear()  # as a coordinator started since holds it
    with pytest.raises(ClusterError, match="no longer kept"):
        returning(cluster, sql, "r-1")
    assert cluster.sql("SELECT sum(n) AS s FROM t WHERE id < 10").to_pylist() == [
        {"s": sum(i % 97 + 1 for i in range(10))}
    ]
    monkeypatch.setattr(node_module, "RETURNED_KEPT_BYTES", 100)  # a big answer: not kept
    assert returning(cluster, "DELETE FROM t WHERE id < 10 RETURNING *", "r-2")[0] == 10
    with pytest.raises(ClusterError, match="no longer kept"):
        returning(cluster, "DELETE FROM t WHERE id < 10 RETURNING *", "r-2")


def test_a_statement_that_fails_on_one_shard_changes_no_shard(cluster: LocalCluster) -> None:
    """The value fails to convert on the one shard holding id 7 only: every other shard
    prepared its part, and none of them may take effect."""
    before = summary(cluster)
    commit = cluster.catalog.table("t").commit
    with pytest.raises(QueryError, match=r"Could not convert|Conversion"):
        change(cluster, "UPDATE t SET n = CAST(CASE WHEN id = 7 THEN 'x' ELSE '5' END AS BIGINT)")
    assert summary(cluster) == before
    assert cluster.catalog.table("t").commit == commit
    for node in sorted({u.node for u in cluster.units("t")}):
        assert not any(s.prepared for s in cluster.workers.get(node).node.shards.values())


def test_inserts_racing_a_delete_are_kept_and_a_query_sees_it_whole_or_not(
    cluster: LocalCluster,
) -> None:
    stop = threading.Event()
    seen: list[int] = []
    inserted: list[int] = []

    def insert() -> None:
        start = ROWS
        while not stop.is_set():
            cluster.insert("t", rows(start, 50))
            inserted.append(start)
            start += 50

    def read() -> None:
        while not stop.is_set():
            seen.append(
                cluster.sql("SELECT count(*) AS n FROM t WHERE id < 3000").column(0)[0].as_py()
            )

    threads = [threading.Thread(target=insert), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    try:
        assert change(cluster, "DELETE FROM t WHERE id < 1500") == 1500
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert set(seen) <= {ROWS, ROWS - 1500}  # never some shards' part of the delete
    expected = ROWS - 1500 + 50 * len(inserted)
    assert cluster.sql("SELECT count(*) AS n FROM t").column(0)[0].as_py() == expected


def test_what_is_not_built_yet_is_refused_saying_so(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = cluster.catalog.table("t").commit
    monkeypatch.setattr(changes_module, "MAX_SHIPPED_ROWS", 100)
    with pytest.raises(UnsupportedError, match="too big to send"):
        change(
            cluster,
            "DELETE FROM t WHERE EXISTS (SELECT 1 FROM t AS u WHERE u.n = t.id AND u.id > t.n)",
        )
    with pytest.raises(QueryError):  # a mistake in a correlated subquery: before any shard
        change(cluster, "DELETE FROM t USING t AS u WHERE u.nope = t.id")
    with pytest.raises(QueryError, match="no column"):
        change(cluster, "UPDATE t SET nope = 1")
    with pytest.raises(QueryError):
        change(cluster, "DELETE FROM t WHERE nope = 1")
    assert cluster.catalog.table("t").commit == commit


def test_a_query_half_way_through_a_change_sees_it_on_every_shard_or_on_none(
    cluster: LocalCluster,
) -> None:
    """The decision logged and told to one node only (the window a session with the old
    routing can fall into): the query answers the table before the change or after it,
    never one node's part of it. With the workers' commit check off
    (``SHARDFLOW_TEST_UNFENCED=commits``) it reads one node changed and the others not."""
    before = summary(cluster)[0]["n"]
    assert before == ROWS  # the session routes commit 0
    node = cluster.backend.node
    statement = "half-told"
    spec = cluster.state.begin_change("t", "changed")
    try:
        rewrite = RowRewrite("t", None, delete=True)
        assert node._prepare(spec, statement, rewrite, None)[0] == ROWS
        cluster.state.commit_change("t", statement, ROWS, ROWS)
        told, *behind = sorted({u.node for u in cluster.units("t")})
        cluster.workers.get(told).sync(cluster.state.catalog_json()).get()
        on_told = sum(1 for u in cluster.units("t") if u.node == told)
        assert 0 < on_told < len(cluster.units("t"))

        def tell_the_rest() -> None:
            threading.Event().wait(0.5)
            for other in behind:
                cluster.workers.get(other).sync(cluster.state.catalog_json()).get()

        teller = threading.Thread(target=tell_the_rest, daemon=True)
        teller.start()
        answer = cluster.sql("SELECT count(*) AS n FROM t").column(0)[0].as_py()
        teller.join()
        assert answer == 0  # the told node said Changed: run again whole at the new commit
    finally:
        cluster.state.end_change("t")


def prepared_anywhere(cluster: LocalCluster) -> set[str]:
    """The statements prepared in any node's shards and not decided."""
    found: set[str] = set()
    for node in cluster.catalog.nodes:
        worker = cluster.workers.get(node).node
        for shard in [*worker.shards.values(), *worker.replicas.values()]:
            found.update(shard.prepared)
    return found


def test_a_change_prepared_and_never_decided_is_dropped_by_the_coordinator(
    cluster: LocalCluster,
) -> None:
    """A coordinator died between prepare and decision and no session tried again: the
    prepared files would hold their shards' checkpoints back until the table's next
    change. The coordinator's sweep drops them; it leaves alone a change committed and not
    yet told to the nodes (they put it in effect when told), and one whose group is being
    changed. Broken on purpose (a committed change dropped too), the table keeps the rows
    the committed DELETE took."""
    node = cluster.backend.node
    orphan, decided = "orphan", "decided-not-told"
    node._prepare(
        cluster.state.catalog.table("t"), orphan, RowRewrite("t", "id < 10", delete=True), None
    )
    assert prepared_anywhere(cluster) == {orphan}
    spec = cluster.state.begin_change("t", "changed")
    try:
        assert node.drop_undecided() == []  # its group is being changed: that change decides
        node._prepare(spec, decided, RowRewrite("t", "id >= 2000", delete=True), None)
        cluster.state.commit_change("t", decided, ROWS - 2000, ROWS - 2000)
    finally:
        cluster.state.end_change("t")
    assert prepared_anywhere(cluster) == {decided}  # the second prepare dropped the first
    assert node.drop_undecided() == []  # committed: left for the nodes to put in effect
    node.announce(cluster.catalog.nodes)
    assert summary(cluster)[0]["n"] == 2000
    assert prepared_anywhere(cluster) == set()
    # an undecided change, left on every node's shards
    node._prepare(
        cluster.state.catalog.table("t"), orphan, RowRewrite("t", "id < 10", delete=True), None
    )
    owners = {u.node for u in cluster.units("t")}
    dropped = node.drop_undecided()
    assert sorted(dropped) == [(n, "t", orphan) for n in sorted(owners)]
    assert prepared_anywhere(cluster) == set()
    for shard in cluster.workers.get(sorted(owners)[0]).node.shards.values():
        assert not any(n.startswith("prep-") for n in shard.store._dir.list(shard.store.folder))
    assert summary(cluster)[0]["n"] == 2000  # nothing of it took effect


def test_a_replicated_table_changes_on_every_node_at_once(cluster: LocalCluster) -> None:
    """A replicated table's copy that writes its log prepares the change; every node's
    copy is made again from the files once it is committed: each node answers the same."""
    cluster.session.create_table("dims", rows(0, 300), None, True, None)
    con = duckdb.connect()
    dims = rows(0, 300)  # noqa: F841 (read by DuckDB by name)
    con.execute("CREATE TABLE dims AS SELECT * FROM dims")
    for sql in (
        "DELETE FROM dims WHERE id % 3 = 0",
        "UPDATE dims SET name = name || '!' WHERE n < 20",
    ):
        assert change(cluster, sql) == con.execute(sql).fetchall()[0][0], sql
    query = "SELECT count(*) AS n, string_agg(name, ',' ORDER BY id) AS names FROM dims"
    expected = con.sql(query).to_arrow_table().to_pylist()
    nodes = sorted({u.node for u in cluster.units("t")})
    for _ in nodes:  # the session reads a replicated table from each node in turn
        assert cluster.sql(query).to_pylist() == expected
    cluster.insert("dims", rows(1000, 5))
    for node in nodes:
        cluster.restart(node)
    for _ in nodes:
        assert cluster.sql(f"{query} WHERE id < 1000").to_pylist() == expected


def test_a_node_not_told_a_table_was_made_again_never_answers_the_one_before(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replicated table changed, dropped, made again with other rows and changed again,
    and one node told none of it (its answers lost, say): its catalog still has the table
    before. The new table's commit numbers start past the old one's, so that node says it
    is behind (``Moved``) and the session reads another node's copy; were they the same
    (both tables changed once), it would answer its copy at that commit, unchanged."""
    cluster.session.create_table("dims", rows(0, 300), None, True, None)
    change(cluster, "DELETE FROM dims WHERE id < 10")
    behind = next(n for n in sorted(cluster.catalog.nodes) if n != cluster.catalog.primary)
    announcer = cluster.controller.announcer
    tell = announcer.announce
    monkeypatch.setattr(announcer, "announce", lambda nodes: tell(set(nodes) - {behind}))
    cluster.session.drop_table("dims")
    cluster.session.create_table("dims", rows(1000, 300), None, True, None)
    change(cluster, "DELETE FROM dims WHERE id < 1010")
    worker = cluster.workers.get(behind).node
    assert worker.catalog.table("dims").uid != cluster.catalog.table("dims").uid
    for _ in cluster.catalog.nodes:  # each node in turn
        answer = cluster.sql("SELECT count(*) AS n, min(id) AS low FROM dims").to_pylist()
        assert answer == [{"n": 290, "low": 1010}]


def test_a_node_that_did_not_take_a_change_is_sent_the_catalog_soon(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose answer to a change was an error is sent the catalog whole by the
    coordinator's watch loop within a few health intervals, with no other change to carry
    it: it serves the table made meanwhile again. Broken on purpose (no catch-up), it
    stays behind."""
    for node in cluster.catalog.nodes:  # each reports its profile, as a Ray worker does
        cluster.state.report_profile(cluster.workers.get(node).node.profile)
    cluster.controller.start()  # the watch loop (a coordinator actor starts it)
    behind = sorted(cluster.catalog.nodes)[-1]
    worker = cluster.workers.get(behind)
    lost = Answered(error=ClusterError("the answer was lost"))
    with monkeypatch.context() as patched:
        patched.setattr(worker, "follow", lambda changes: lost)
        patched.setattr(worker, "sync", lambda catalog: lost)
        cluster.session.create_table("dims", rows(0, 300), None, True, None)
    assert worker.node.catalog.find_table("dims") is None
    deadline = time.monotonic() + 10 * cluster.settings.health_interval_s
    while worker.node.catalog.version < cluster.state.catalog.version:
        assert time.monotonic() < deadline, "the node was left behind"
        time.sleep(0.05)
    assert worker.node.catalog.table("dims").uid == cluster.catalog.table("dims").uid


def test_subqueries_are_answered_first_and_their_values_used(cluster: LocalCluster) -> None:
    """An uncorrelated subquery in WHERE or SET runs as a query first; the statement then
    uses its answer (IN lists, EXISTS, scalar values, none and NULL among them)."""
    cluster.create_table("picks", pa.table({"k": pa.array([3, 5, 8, 2999, None], pa.int64())}), "k")
    con = oracle()
    con.execute(
        "CREATE TABLE picks AS SELECT * FROM (VALUES (3), (5), (8), (2999), (NULL)) AS v(k)"
    )
    for sql in (
        "DELETE FROM t WHERE id IN (SELECT k FROM picks)",
        "DELETE FROM t WHERE id NOT IN (SELECT k FROM picks WHERE k < 0) AND id > 2990",
        "UPDATE t SET n = (SELECT max(k) FROM picks) WHERE id < 20",
        "UPDATE t SET name = 'none' WHERE n = (SELECT k FROM picks WHERE k < 0)",
        "DELETE FROM t WHERE EXISTS (SELECT 1 FROM picks WHERE k = 8) AND id BETWEEN 40 AND 49",
        "DELETE FROM t WHERE id > (SELECT avg(id) FROM t) + 1000",
    ):
        changes_as_duckdb(cluster, con, sql)
    with pytest.raises(QueryError, match="More than one row"):
        change(cluster, "UPDATE t SET n = (SELECT k FROM picks) WHERE id = 1")


def test_rows_chosen_by_other_tables_and_correlated_subqueries_as_duckdb_does(
    cluster: LocalCluster,
) -> None:
    """``DELETE ... USING``, ``UPDATE ... FROM`` and subqueries that read the changed row:
    every shard evaluates them per row over whole copies of the tables they read, which
    the session sends along; answers and rows as DuckDB's."""
    prices = pa.table(
        {
            "k": pa.array([3, 5, 8, 97, 2999, 40, 41], pa.int64()),
            "price": pa.array([1.5, 2.5, None, 4.0, 5.0, 6.0, 7.0]),
            "tag": pa.array(["a", "b", "c", "d", "e", "f", "g"]),
        }
    )
    cluster.create_table("prices", prices, "k")
    con = oracle()
    con.register("prices_rows", prices)
    con.execute("CREATE TABLE prices AS SELECT * FROM prices_rows")
    counts: list[int] = []
    for sql in (
        "WITH cheap AS (SELECT k FROM prices WHERE price < 3), few AS (SELECT k FROM cheap) "
        "DELETE FROM t WHERE id IN (SELECT k FROM few)",  # the names read as subqueries
        "WITH v(k2, tag2) AS (SELECT k, tag FROM prices) UPDATE t SET name = tag2 FROM v "
        "WHERE k2 = t.id",  # its columns named by the WITH
        "DELETE FROM t AS x USING (VALUES (7), (8)) AS v(i) WHERE x.id = v.i",
        "UPDATE t SET name = p.tag, n = t.n + 1000 FROM prices AS p WHERE p.k = t.id",
        "DELETE FROM t USING prices WHERE t.id = prices.k AND prices.price > 2",
        "DELETE FROM t AS x USING prices AS p WHERE x.n = p.k",
        "UPDATE t SET n = (SELECT count(*) FROM prices WHERE prices.k < t.id) WHERE id < 60",
        "DELETE FROM t WHERE EXISTS (SELECT 1 FROM t AS u WHERE u.id = t.id + 1 AND u.n = 0)",
        "DELETE FROM t WHERE n > (SELECT avg(u.n) FROM t AS u WHERE u.id % 10 = t.id % 10) + 40",
        "UPDATE t SET id = id + 5000 FROM prices WHERE prices.k = t.id - 1",  # moves rows
    ):
        counts.append(changes_as_duckdb(cluster, con, sql))
    assert all(counts), counts  # every statement changed rows
    for key in (5004, 5006, 5042, 5098):  # moved by the last: each found where its key routes
        assert cluster.sql(f"SELECT count(*) AS n FROM t WHERE id = {key}").to_pylist() == (
            con.sql(f"SELECT count(*) AS n FROM t WHERE id = {key}").to_arrow_table().to_pylist()
        )


def test_rows_chosen_by_a_table_too_big_to_send_by_one_column_go_as_its_values(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DELETE ... USING u WHERE t.k = u.x AND <u's own conditions>`` (or the EXISTS it
    reads as) needs of ``u`` only the values of ``u.x``: they go with the statement (as
    ``t.k IN (...)``, routed by them where ``k`` is the key), not the whole table, which
    may then be bigger than a table a correlated subquery can send to every shard. Rows
    and counts as DuckDB's; a condition that reads the changed row twice still sends."""
    monkeypatch.setattr(changes_module, "MAX_SHIPPED_ROWS", 100)
    gone = pa.table(
        {"k": pa.array(range(0, 3000, 3), pa.int64()), "flag": [i % 2 for i in range(1000)]}
    )
    cluster.create_table("gone", gone, "k")
    con = oracle()
    con.register("gone_rows", gone)
    con.execute("CREATE TABLE gone AS SELECT * FROM gone_rows")
    asked: list[object] = []
    prepare = cluster.backend.node._prepare

    def recorded(spec: object, statement: str, change: object, buckets: object) -> object:
        asked.append(buckets)
        return prepare(spec, statement, change, buckets)  # type: ignore[arg-type]

    monkeypatch.setattr(cluster.backend.node, "_prepare", recorded)
    for sql in (
        "DELETE FROM t USING gone WHERE t.id = gone.k AND gone.flag = 1 AND gone.k < 90",
        "DELETE FROM t USING gone WHERE t.id = gone.k AND gone.k = 300",  # the rest kept
        "DELETE FROM t USING gone WHERE t.id = gone.k AND gone.flag = 1",
        "UPDATE t SET name = 'x' WHERE EXISTS (SELECT 1 FROM gone AS g WHERE g.k + 1 = t.id)",
        "DELETE FROM t AS x WHERE x.id < 40 AND EXISTS (SELECT 1 FROM gone WHERE gone.k = x.n)",
    ):
        changes_as_duckdb(cluster, con, sql)
    assert asked[0] is not None  # t.id IN (...): routed to the shards of those keys
    for sent in (
        "DELETE FROM t USING gone WHERE t.id = gone.k AND gone.flag = t.n",
        # an aggregate answers a row for every t: no values can stand for the subquery
        "UPDATE t SET n = 7 WHERE EXISTS (SELECT count(*) FROM gone WHERE gone.k = t.id)",
    ):
        with pytest.raises(UnsupportedError, match="too big to send"):
            change(cluster, sent)


def test_an_update_of_the_key_moves_rows_to_their_new_shards(cluster: LocalCluster) -> None:
    """Rows whose new key another shard owns are deleted where they were and inserted
    there, in the same statement (all or nothing); each row is then found by its key
    (routed to its shard), and stays so across restarts."""
    con = oracle()
    for sql in (
        "UPDATE t SET id = id + 100000 WHERE id % 5 = 0",
        "UPDATE t SET id = -id, name = 'moved' WHERE id BETWEEN 10 AND 20",
        "UPDATE t SET id = id * 2 WHERE id = 7",
    ):
        assert change(cluster, sql) == con.execute(sql).fetchall()[0][0], sql
        assert summary(cluster) == con.sql(SUMMARY).to_arrow_table().to_pylist(), sql
    for key in (100000, 100995, -11, 14):  # each where the key routes
        lookup = f"SELECT id, name FROM t WHERE id = {key}"
        expected = [{"id": i, "name": name} for i, name in con.execute(lookup).fetchall()]
        assert expected and cluster.sql(lookup).to_pylist() == expected, key
    for node in sorted({u.node for u in cluster.units("t")}):
        cluster.restart(node)
    assert summary(cluster) == con.sql(SUMMARY).to_arrow_table().to_pylist()
    before = summary(cluster)
    with pytest.raises(QueryError):  # fails on one shard only: no row moves anywhere
        change(cluster, "UPDATE t SET id = CAST(CASE WHEN id = 1 THEN 'x' ELSE '5' END AS BIGINT)")
    assert summary(cluster) == before


def test_the_balancers_moves_do_not_wait_for_a_change_that_waits_for_them(
    cluster: LocalCluster,
) -> None:
    """The balancer reserves every move of a decision before it runs any, and a change of
    rows waits for the moves reserved: were the balancer's second move to wait for the
    change, neither would ever end (a bank run hung so). Its moves are refused at once
    while a change runs, and tried again at its next decision; a move asked for by an
    operator waits for the change instead, and then runs."""
    units = cluster.units("t")
    cluster.state.begin_change("t", "changed")
    try:
        moves = tuple(
            balancer.Move(u.unit_id, next(n for n in ("node-0", "node-1") if n != u.node), 0, "t")
            for u in units[:2]
        )
        decision = balancer.Decision(moves, "test", "load", 0.0, 0.0)
        started = time.monotonic()
        assert cluster.controller.carry_out(decision) == []  # both refused, none waited
        assert time.monotonic() - started < 5
        waiting = threading.Thread(target=cluster.migrate, args=(moves[0].unit_id, moves[0].to))
        waiting.start()
        group = cluster.catalog.table("t").group
        while not cluster.state.waiting_moves[group]:
            time.sleep(0.01)
    finally:
        cluster.state.end_change("t")
    waiting.join()
    assert cluster.catalog.group_of("t").unit(units[0].unit_id).node == moves[0].to


def test_a_where_that_fixes_the_key_asks_only_the_shards_of_its_keys(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DELETE FROM t WHERE id = 7``: the key named as DuckDB reads it (no table before
    it, any case) routes the statement to the units of its values, and only their nodes
    prepare; a WHERE that does not fix the key asks every unit. Rows as DuckDB's."""
    con = oracle()
    asked: list[object] = []
    prepared: list[str] = []
    prepare = cluster.backend.node._prepare

    def recorded(spec: object, statement: str, change: object, buckets: object) -> object:
        asked.append(buckets)
        return prepare(spec, statement, change, buckets)  # type: ignore[arg-type]

    for node in cluster.catalog.nodes:
        worker = cluster.workers.get(node)
        original = worker.prepare_change

        def counted(*args: object, _node: str = node, _call: Any = original) -> Any:
            prepared.append(_node)
            return _call(*args)

        monkeypatch.setattr(worker, "prepare_change", counted)
    monkeypatch.setattr(cluster.backend.node, "_prepare", recorded)
    units = cluster.units("t")
    assert len({unit.node for unit in units}) > 1
    for sql in (
        "DELETE FROM t WHERE id = 7",
        "UPDATE t SET n = n + 1 WHERE ID IN (11, 12) AND n > 0",
        "DELETE FROM t AS x WHERE x.id = 21",
    ):
        prepared.clear()
        changes_as_duckdb(cluster, con, sql)
        buckets = asked[-1]
        assert buckets is not None, sql
        group = cluster.catalog.group_of("t")
        owners = {int(u) for u in group.owners_of(np.asarray(buckets, np.int64))}
        nodes = {unit.node for unit in units if unit.unit_id in owners}
        assert sorted(prepared) == sorted(nodes) and len(nodes) < 3, (sql, prepared)
    prepared.clear()
    changes_as_duckdb(cluster, con, "DELETE FROM t WHERE id = 30 OR id = 31")
    assert asked[-1] is None and sorted(prepared) == sorted({u.node for u in units})
