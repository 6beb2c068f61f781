"""Clients others wrote against ``shardflow serve``: the ADBC Flight SQL driver (DB-API) and
plain ``pyarrow.flight``; and shardflow's own remote ``connect``. Answers are checked
against DuckDB on the same rows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import adbc_driver_flightsql.dbapi as flight_sql
import adbc_driver_manager
import duckdb
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import shardflow
from shardflow.errors import MoveRefusedError
from shardflow.flightsql import wire as fsql
from shardflow.storage import backup as backups
from tests.service.conftest import PASSWORDS, Served, sample_table
from tests.service.test_safety import audit

pytestmark = pytest.mark.cluster


def adbc(served: Served, user: str) -> flight_sql.Connection:
    return flight_sql.connect(
        served.uri,
        db_kwargs={"username": user, "password": PASSWORDS[user]},
        autocommit=True,
    )


@pytest.fixture()
def reader(served: Served) -> Iterator[flight_sql.Connection]:
    with adbc(served, "alice") as conn:
        yield conn


def oracle(query: str, **tables: pa.Table) -> pa.Table:
    con = duckdb.connect()
    for name, table in tables.items():
        con.register(name, table)
    return con.sql(query).to_arrow_table()


def same_rows(got: pa.Table, expected: pa.Table) -> None:
    assert got.column_names == expected.column_names
    assert sorted(got.to_pylist(), key=repr) == sorted(expected.to_pylist(), key=repr)


def test_adbc_query_fetches_arrow_equal_to_duckdb(reader: flight_sql.Connection) -> None:
    query = "SELECT g, count(*) AS n, sum(x) AS total, min(d) AS first FROM t GROUP BY g"
    with reader.cursor() as cur:
        cur.execute(query)
        got = cur.fetch_arrow_table()
    same_rows(got, oracle(query, t=sample_table()))
    with reader.cursor() as cur:
        cur.execute("SELECT * FROM t WHERE id < 10 ORDER BY id")
        assert [r[0] for r in cur.fetchall()] == list(range(10))


def test_adbc_parameters_bind_as_values(reader: flight_sql.Connection) -> None:
    query = "SELECT count(*) AS n FROM t WHERE g = ? AND s = ? AND id >= ?"
    with reader.cursor() as cur:
        cur.execute(query, parameters=(3, "item-17", 100))
        got = cur.fetchall()
    expected = oracle(
        "SELECT count(*) AS n FROM t WHERE g = 3 AND s = 'item-17' AND id >= 100", t=sample_table()
    )
    assert got == [(expected["n"][0].as_py(),)]
    with reader.cursor() as cur:  # a quote in a value stays a value
        cur.execute("SELECT count(*) FROM t WHERE s = ?", parameters=("x' OR '1'='1",))
        assert cur.fetchall() == [(0,)]


def test_adbc_ingest_create_append_and_exactly_once(served: Served) -> None:
    rows = pa.table({"k": pa.array([1, 2, 3], pa.int64()), "v": ["a", "b", "c"]})
    with adbc(served, "bob") as conn, conn.cursor() as cur:
        assert cur.adbc_ingest("ingested", rows, mode="create") == 3
        assert cur.adbc_ingest("ingested", rows, mode="append") == 3
        with pytest.raises(adbc_driver_manager.Error, match="TableExistsError"):
            cur.adbc_ingest("ingested", rows, mode="create")
        cur.execute("SELECT count(*), sum(k) FROM ingested")
        assert cur.fetchall() == [(6, 12)]
    # the same batch id twice keeps the rows once (a client's retry after a lost answer)
    with shardflow.connect(served.uri, user="bob", password=PASSWORDS["bob"]) as db:
        db.insert("ingested", rows, batch_id="retry-1")
        db.insert("ingested", rows, batch_id="retry-1")
        assert db.sql("SELECT count(*) AS n FROM ingested")["n"][0].as_py() == 9
        db.drop_table("ingested")


def test_adbc_changes_rows_and_reads_what_returning_gives(served: Served) -> None:
    """DELETE and UPDATE through ADBC: a query answers the count, or with ``RETURNING``
    the rows as DuckDB's own statement gives them; an update (Flight SQL's
    ExecuteUpdate) answers the rows changed either way."""
    rows = pa.table({"k": pa.array(range(1, 7), pa.int64()), "v": list("abcdef")})
    with adbc(served, "bob") as conn, conn.cursor() as cur:
        cur.adbc_ingest("changing", rows, mode="create")
        expected = duckdb.connect()
        expected.register("source", rows)
        expected.execute("CREATE TABLE changing AS SELECT * FROM source")
        for sql in (
            "UPDATE changing SET v = v || '!' WHERE k <= 2 RETURNING k, v",
            "DELETE FROM changing WHERE k = 3",
            "DELETE FROM changing WHERE k > 4 RETURNING *",
        ):
            cur.execute(sql)
            assert sorted(cur.fetchall()) == sorted(expected.execute(sql).fetchall()), sql
        with conn.cursor() as fresh:
            fresh.adbc_statement.set_sql_query("UPDATE changing SET k = k * 10 RETURNING k")
            assert fresh.adbc_statement.execute_update() == 3
        cur.execute("SELECT k, v FROM changing ORDER BY k")
        assert cur.fetchall() == [(10, "a!"), (20, "b!"), (40, "d")]
        cur.execute("DROP TABLE changing")


def test_adbc_get_objects_and_table_schema(reader: flight_sql.Connection) -> None:
    objects = reader.adbc_get_objects().read_all().to_pylist()
    catalogs = {c["catalog_name"]: c for c in objects}
    schemas = catalogs["shardflow"]["catalog_db_schemas"]
    tables = {t["table_name"]: t for s in schemas for t in s["db_schema_tables"]}
    assert "t" in tables and tables["t"]["table_type"] == "TABLE"
    assert [c["column_name"] for c in tables["t"]["table_columns"]] == ["id", "g", "s", "x", "d"]
    assert reader.adbc_get_table_schema("t") == sample_table().schema
    assert reader.adbc_get_table_types() == ["TABLE"]
    info = reader.adbc_get_info()
    assert info["vendor_name"] == "shardflow"


def test_adbc_errors_are_dbapi_exceptions_with_shardflow_messages(
    reader: flight_sql.Connection,
) -> None:
    with reader.cursor() as cur:
        with pytest.raises(adbc_driver_manager.ProgrammingError, match="UnknownTableError"):
            cur.execute("SELECT * FROM no_such_table")
        with pytest.raises(adbc_driver_manager.ProgrammingError, match=r"SqlSyntaxError|Parser"):
            cur.execute("SELEC oops FROM")
        with pytest.raises(adbc_driver_manager.ProgrammingError, match="PermissionDeniedError"):
            cur.adbc_ingest("t", sample_table(1), mode="append")
        cur.execute("SELECT count(*) FROM t")  # the connection still works
        assert cur.fetchall() == [(2000,)]


def test_plain_pyarrow_flight_calls(served: Served) -> None:
    client = flight.FlightClient(served.uri)
    header = client.authenticate_basic_token("alice", PASSWORDS["alice"])
    options = flight.FlightCallOptions(headers=[header])
    command = fsql.pack(fsql.new("CommandStatementQuery", query="SELECT sum(id) AS s FROM t"))
    info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
    assert info.schema.names == ["s"]
    table = client.do_get(info.endpoints[0].ticket, options).read_all()
    assert table["s"][0].as_py() == sum(range(2000))
    with pytest.raises(pa.ArrowKeyError, match="unknown or expired ticket"):
        client.do_get(info.endpoints[0].ticket, options).read_all()  # a ticket is read once
    actions = {a.type for a in client.list_actions(options)}
    assert {"migrate", "CreatePreparedStatement", "tables"} <= actions
    tables = client.do_action(flight.Action("tables", b"{}"), options)
    listed = pa.ipc.open_stream(next(iter(tables)).body).read_all()
    assert "t" in listed["name"].to_pylist()
    client.close()


def test_remote_database_has_the_local_methods(served: Served, tmp_path: Path) -> None:
    with shardflow.connect(served.uri, user="olga", password=PASSWORDS["olga"]) as db:
        assert db.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000
        picked = db.sql("SELECT id, s FROM t WHERE id = ? AND s = $2", [7, "item-7"])
        assert picked.to_pylist() == [{"id": 7, "s": "item-7"}]
        assert "pushdown" in db.explain("SELECT * FROM t WHERE id = 3")
        nodes = db.cluster.nodes()
        assert len(nodes) == 2 and all(n.alive for n in nodes)
        shards = db.cluster.shards()
        moving = shards.filter(pa.compute.equal(shards["table"], "t"))[0:1].to_pylist()[0]
        target = next(n.node_id for n in nodes if n.node_id != moving["node"])
        record = db.cluster.migrate(moving["shard"], target)
        assert record.phase == "done" and target in record.to_nodes
        after = db.cluster.shards().to_pylist()
        assert {r["node"] for r in after if r["shard"] == moving["shard"]} == {target}
        assert db.cluster.migrations()[-1].move_id == record.move_id
        assert db.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000
        assert db.cluster.settings()["max_request_mb"] == 256
        plan = db.cluster.rebalance(dry_run=True)
        assert isinstance(plan, dict)
        json.dumps(plan)
        assert db.cluster.cancel_drain(nodes[0].node_id) is False  # no drain runs
        assert db.cluster.pause_balancer() is False and db.cluster.pause_balancer() is True
        assert db.cluster.resume_balancer() is True
        with pytest.raises(MoveRefusedError, match="ended already"):
            db.cluster.cancel(record.move_id)
        taken = db.cluster.backup(str(tmp_path / "backups"))  # written by the service
        assert taken.tables >= 1 and taken.bytes > 0
        report = backups.verify(str(tmp_path / "backups"))
        assert report.ok and report.backups == 1
        logged = [e for e in audit(served) if e["action"] == "backup"]
        assert logged[-1]["who"] == "olga" and logged[-1]["outcome"] == "ok"


def test_adbc_fetches_an_answer_bigger_than_one_grpc_message(served: Served) -> None:
    """ADBC refuses gRPC messages over 16 MiB: a 48 MB answer must come in many batches."""
    import numpy as np

    values = np.arange(3_000_000, dtype=np.int64)
    rows = pa.table({"v": values, "w": values * 2})
    stream = pa.RecordBatchReader.from_batches(rows.schema, rows.to_batches(500_000))
    with shardflow.connect(served.uri, user="olga", password=PASSWORDS["olga"]) as db:
        db.create_table("big", stream, distributed_by="v", key_index=True)  # sent whole
        (big,) = [t for t in db.tables().to_pylist() if t["name"] == "big"]
        assert big["key_index"] is True  # the option went along
        db.sql("GRANT SELECT ON big TO alice")
    with adbc(served, "alice") as conn, conn.cursor() as cur:
        cur.execute("SELECT v, w FROM big")
        got = cur.fetch_arrow_table()
    assert got.num_rows == 3_000_000 and got.nbytes > 16 << 20
    assert pa.compute.sum(got["w"]).as_py() == 2 * int(values.sum())


def update(served: Served, query: str) -> int:
    """A Flight SQL ``CommandStatementUpdate`` as bob: the record count it answers."""
    client = flight.FlightClient(served.uri)
    header = client.authenticate_basic_token("bob", PASSWORDS["bob"])
    command = fsql.pack(fsql.new("CommandStatementUpdate", query=query))
    descriptor = flight.FlightDescriptor.for_command(command)
    writer, metadata = client.do_put(descriptor, pa.schema([]), flight.FlightCallOptions(
        headers=[header]))  # fmt: skip
    with writer:
        writer.done_writing()
        answer = metadata.read()
    client.close()
    result = fsql.new("DoPutUpdateResult")
    result.ParseFromString(answer.to_pybytes())
    return int(result.record_count)


def test_adbc_write_statements_for_a_writer(served: Served) -> None:
    with adbc(served, "bob") as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE evens AS SELECT id, s FROM t WHERE id % 2 = 0")
        cur.execute("INSERT INTO evens VALUES (?, ?)", parameters=(5001, "new"))
        cur.execute("INSERT INTO evens SELECT id, s FROM t WHERE id = 1")
        cur.execute("SELECT count(*), max(id) FROM evens")
        assert cur.fetchall() == [(1002, 5001)]
        cur.execute("TRUNCATE evens")
        assert cur.fetchall() == [(1002,)]  # its answer: the rows it emptied
        cur.execute("SELECT count(*) FROM evens")
        assert cur.fetchall() == [(0,)]
        # a Flight SQL update (DoPut) answers the rows a statement added or emptied
        assert update(served, "INSERT INTO evens VALUES (7, 'x'), (9, 'y')") == 2
        assert update(served, "TRUNCATE TABLE evens") == 2
        assert update(served, "DROP TABLE IF EXISTS nothing_here") == -1  # unknown: -1
        cur.execute("DROP TABLE evens")
        cur.execute("DROP TABLE IF EXISTS evens")
        with pytest.raises(adbc_driver_manager.ProgrammingError, match="UnknownTableError"):
            cur.execute("SELECT * FROM evens")
