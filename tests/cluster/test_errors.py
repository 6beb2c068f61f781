"""Bad input fails with a documented error that says what is wrong; nothing is left half
written and no worker crashes."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardflow

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(
    ("sql", "error", "message"),
    [
        ("SELEC * FROM orders", shardflow.SqlSyntaxError, r'near "SELEC"\n\nLINE 1: SELEC'),
        ("SELECT FROM WHERE", shardflow.SqlSyntaxError, 'near "WHERE"'),
        (
            "SELECT o_orderkey,, o_custkey FROM orders",
            shardflow.SqlSyntaxError,
            r'near ","\n\nLINE 1',
        ),
        ("", shardflow.SqlSyntaxError, "empty"),
        ("SELECT * FROM no_such_table", shardflow.UnknownTableError, "no_such_table"),
        ("SELECT no_such_column FROM orders", shardflow.UnknownColumnError, "no_such_column"),
        (
            "SELECT o_orderkey FROM orders o JOIN lineitem l ON o.x = l.l_orderkey",
            shardflow.UnknownColumnError,
            "x",
        ),
        ("INSERT INTO orders VALUES (1)", shardflow.SchemaMismatchError, "missing column"),
        (
            "DELETE FROM orders WHERE EXISTS (SELECT 1 FROM customer WHERE c_nope = o_custkey)",
            shardflow.UnknownColumnError,
            "c_nope",
        ),
        (
            "DELETE FROM orders USING customer WHERE c_custkey = o_custkey RETURNING c_nope",
            shardflow.UnknownColumnError,
            "c_nope",
        ),
        (
            "WITH RECURSIVE v AS (SELECT 1 AS a) DELETE FROM orders USING v WHERE o_orderkey = a",
            shardflow.UnsupportedError,
            "WITH RECURSIVE before DELETE",
        ),
        (
            "WITH v AS (SELECT 1 AS a) INSERT INTO orders WITH w AS (SELECT 2) SELECT * FROM v",
            shardflow.UnsupportedError,
            "WITH before INSERT and another",
        ),
        ("UPDATE orders SET o_orderkey = 'x'", shardflow.QueryError, r"(?i)conver|cast"),
        ("UPDATE orders SET o_comment = DEFAULT", shardflow.UnsupportedError, "no column defaults"),
        ("UPDATE orders SET o_custkey = 'x'", shardflow.QueryError, r"(?i)conver|cast"),
        ("DELETE FROM orders WHERE nope = 1", shardflow.UnknownColumnError, "nope"),
        ("CREATE TABLE t2 (a INTEGER)", shardflow.QueryError, "a column list alone"),
        ("SELECT 1; SELECT 2", shardflow.UnsupportedError, "one statement"),
        ("SELECT o_orderkey + 'abc' FROM orders", shardflow.QueryError, r"(?i)conver|cast"),
        (
            "SELECT no_such_function(o_orderkey) FROM orders",
            shardflow.QueryError,
            "no_such_function",
        ),
    ],
)
def test_bad_queries(db: shardflow.Database, sql: str, error: type, message: str) -> None:
    orders = "SELECT count(*) AS n, sum(o_orderkey) AS k, sum(o_custkey) AS c FROM orders"
    before = db.sql(orders).to_pylist()
    with pytest.raises(error, match=message):
        db.sql(sql)
    assert db.sql(orders).to_pylist() == before  # a refused statement changed nothing


def test_runtime_error_on_a_worker_is_reported_and_the_worker_lives(
    db: shardflow.Database,
) -> None:
    with pytest.raises(shardflow.QueryError, match=r"(?i)conver"):
        db.sql("SELECT CAST(o_comment AS INTEGER) FROM orders")
    assert db.sql("SELECT count(*) AS n FROM orders").column("n")[0].as_py() == 150_000
    assert all(node.alive for node in db.cluster.nodes())


def test_query_must_be_text(db: shardflow.Database) -> None:
    with pytest.raises(shardflow.SqlSyntaxError, match="string"):
        db.sql(42)  # type: ignore[arg-type]


def _waits() -> pa.Table:
    """A table whose key is a duration: a distribution key, but not one DuckDB indexes."""
    return pa.table({"wait": pa.array([1, 2, 3], pa.duration("s")), "n": [1, 2, 3]})


def _people() -> pa.Table:
    return pa.table(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "name": ["a", "b", "c"],
            "score": pa.array([1.5, 2.5, 3.5]),
        }
    )


def test_bad_inserts_leave_no_rows(db: shardflow.Database) -> None:
    db.create_table("people_err", _people(), distributed_by="id")
    bad = [
        pa.table({"id": [4], "name": ["d"]}),  # missing column
        pa.table({"id": [4], "name": ["d"], "score": [1.0], "extra": [1]}),  # extra
        pa.table({"id": ["four"], "name": ["d"], "score": [1.0]}),  # wrong type
        pa.table({"id": [4, 5], "name": ["d", "e"], "score": ["x", "y"]}),  # wrong type
        "not a table",
    ]
    for data in bad:
        with pytest.raises(shardflow.SchemaMismatchError):
            db.insert("people_err", data)  # type: ignore[arg-type]
    with pytest.raises(shardflow.UnknownTableError, match="nope"):
        db.insert("nope", _people())
    assert db.sql("SELECT count(*) FROM people_err")[0][0].as_py() == 3
    db.drop_table("people_err")


def readable(error: BaseException) -> None:
    """A shardflow error a person can read: no Ray wrapper, actor header or traceback."""
    assert type(error).__module__ == "shardflow.errors", type(error).__mro__
    text = str(error)
    for noise in ("ray::", "Traceback", "\x1b[", "RayTaskError", 'File "'):
        assert noise not in text, text


def test_bad_table_definitions(db: shardflow.Database, tmp_path: Path) -> None:
    before = db.tables().column("name").to_pylist()
    catalog = Path(db._backend.handle.data_dir) / "catalog"
    versions = sorted(catalog.iterdir())
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "mixed" / "1.parquet")
    pq.write_table(pa.table({"id": ["x"], "more": [1.5]}), tmp_path / "mixed" / "2.parquet")
    rows = pa.table({"id": pa.array(range(200_000)), "s": [str(i) for i in range(200_000)]})
    pq.write_table(rows, tmp_path / "corrupt.parquet", row_group_size=50_000)
    with open(tmp_path / "corrupt.parquet", "r+b") as corrupt:  # a bad page halfway through
        corrupt.seek(corrupt.seek(0, 2) // 2)
        corrupt.write(b"\xff" * 2000)
    cases = [
        (
            dict(name="t1", source=tmp_path / "corrupt.parquet", distributed_by="id"),
            shardflow.TableError,
        ),
        (dict(name="t1", source=tmp_path / "empty"), shardflow.TableError),
        (dict(name="t1", source=tmp_path / "mixed", distributed_by="id"), shardflow.TableError),
        (dict(name="orders", source=_people()), shardflow.TableExistsError),
        (dict(name="bad name!", source=_people()), shardflow.TableError),
        (dict(name="t1", source=tmp_path / "missing.parquet"), shardflow.TableError),
        (dict(name="t1", source=[1, 2, 3]), shardflow.TableError),
        (dict(name="t1", source=_people(), distributed_by="nope"), shardflow.UnknownColumnError),
        (
            dict(name="t1", source=_people(), distributed_by="id", replicated=True),
            shardflow.TableError,
        ),
        (dict(name="t1", source=_people(), colocate_with="orders"), shardflow.TableError),
        (dict(name="t1", source=_people(), key_index=True), shardflow.TableError),
        (dict(name="t1", source=_people(), replicated=True, key_index=True), shardflow.TableError),
        (
            dict(name="t1", source=_waits(), distributed_by="wait", key_index=True),
            shardflow.TableError,
        ),
        (
            dict(name="t1", source=_people(), distributed_by="id", colocate_with="nope"),
            shardflow.UnknownTableError,
        ),
        (
            dict(name="t1", source=_people(), distributed_by="id", colocate_with="nation"),
            shardflow.TableError,
        ),
        (
            dict(name="t1", source=_people(), distributed_by="name", colocate_with="orders"),
            shardflow.TableError,
        ),
    ]
    for kwargs, error in cases:
        with pytest.raises(error) as raised:
            db.create_table(**kwargs)  # type: ignore[arg-type]
        readable(raised.value)
    assert db.tables().column("name").to_pylist() == before
    assert sorted(catalog.iterdir()) == versions  # no catalog change was left behind


def test_drop_and_recreate(db: shardflow.Database) -> None:
    db.create_table("people_drop", _people(), replicated=True)
    assert db.sql("SELECT sum(id) FROM people_drop")[0][0].as_py() == 6
    db.drop_table("people_drop")
    with pytest.raises(shardflow.UnknownTableError):
        db.sql("SELECT * FROM people_drop")
    with pytest.raises(shardflow.UnknownTableError):
        db.drop_table("people_drop")
    db.create_table("people_drop", _people().slice(0, 1), distributed_by="id")
    assert db.sql("SELECT count(*) FROM people_drop")[0][0].as_py() == 1
    db.drop_table("people_drop")


def test_the_api_names_tables_and_columns_by_duckdbs_rule(db: shardflow.Database) -> None:
    db.create_table("People_Names", _people(), distributed_by="ID")
    try:
        assert db.tables().column("name").to_pylist().count("People_Names") == 1
        upper = _people().rename_columns([n.upper() for n in _people().column_names])
        assert db.insert("PEOPLE_NAMES", upper) == 3
        assert db.sql("SELECT count(*) AS n FROM people_names").to_pylist() == [{"n": 6}]
        with pytest.raises(shardflow.TableExistsError, match="already exists as 'People_Names'"):
            db.create_table("people_names", _people(), replicated=True)
        with pytest.raises(shardflow.SchemaMismatchError, match="duplicate"):
            db.insert("people_names", pa.table({"id": [1], "ID": [2], "name": ["x"]}))
    finally:
        db.drop_table("PEOPLE_NAMES")
    with pytest.raises(shardflow.UnknownTableError):
        db.sql("SELECT * FROM People_Names")


def test_a_process_serving_an_embedded_cluster_cannot_also_join_another(
    db: shardflow.Database, tmp_path: Path
) -> None:
    """One process is attached to one Ray cluster: joining another by address while an
    embedded cluster runs here is refused (it would silently have used the embedded one)."""
    with pytest.raises(shardflow.ConfigError, match=r"embedded cluster.*one Ray cluster"):
        shardflow.connect(address="127.0.0.1:6379", data_dir=tmp_path / "other")
    assert db.sql("SELECT 1 AS one")[0][0].as_py() == 1  # the embedded one is unharmed
