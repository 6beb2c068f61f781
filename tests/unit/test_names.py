"""Table and column names match as DuckDB matches them, checked against DuckDB itself."""

from __future__ import annotations

import uuid

import duckdb
import pyarrow as pa
import pytest
from sqlglot.dialects.dialect import Dialect

from shardflow import TableError, TableExistsError
from shardflow.catalog import Catalog, TableSpec, find_name, name_key
from shardflow.catalog.names import duplicate_names

PAIRS = [
    ("lineitem", "LINEITEM"),
    ("LineItem", "lINEiTEM"),
    ("o_orderkey", "O_ORDERKEY"),
    ("Straße", "STRASSE"),  # no Unicode case folding: ß is not ss
    ("Straße", "STRAßE"),  # ...but the ASCII letters around it fold
    ("Äpfel", "äpfel"),  # no Unicode lowercasing either
    ("Äpfel", "ÄPFEL"),
    ("\u212a", "k"),  # KELVIN SIGN is not K
    ("ﬀ", "ff"),
    ("İx", "ix"),
    ("Σσ", "σς"),
    ("ǅx", "ǆx"),
    ("a b", "A B"),
    ("x1", "x_1"),
]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_name_key_matches_duckdb_table_names(first: str, second: str) -> None:
    con = duckdb.connect()
    con.execute(f'CREATE TABLE "{first}" (a INT)')
    try:
        con.execute(f'CREATE TABLE "{second}" (b INT)')
        duckdb_same = False
    except duckdb.CatalogException:
        duckdb_same = True
    assert (name_key(first) == name_key(second)) is duckdb_same


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_name_key_matches_duckdb_column_names(first: str, second: str) -> None:
    con = duckdb.connect()
    con.execute(f'CREATE TABLE t ("{first}" INT)')
    try:
        names = con.sql(f'SELECT "{second}" FROM t').columns
        found = True
    except duckdb.BinderException:
        found = False
    assert (name_key(first) == name_key(second)) is found
    if found:
        assert names == [first]  # DuckDB names the column as it was created


def test_sqlglot_normalises_duckdb_identifiers_by_the_same_rule() -> None:
    """The planner qualifies with SQLGlot's DuckDB dialect: it must fold names as we do."""
    from sqlglot import exp

    dialect = Dialect.get_or_raise("duckdb")
    for first, second in PAIRS:
        for name in (first, second):
            for quoted in (False, True):
                folded = dialect.normalize_identifier(exp.to_identifier(name, quoted=quoted))
                assert folded.name == name_key(name)


def test_find_name_and_duplicates() -> None:
    assert find_name(["Straße", "STRASSE"], "strasse") == "STRASSE"
    assert find_name(["Straße", "STRASSE"], "STRAßE") == "Straße"
    assert find_name(["Äpfel"], "äpfel") is None
    assert duplicate_names(["a", "B", "A", "b", "c"]) == ["A", "b"]


SCHEMA = pa.schema([("k", pa.int64()), ("V", pa.string())])


def _spec(name: str, schema: pa.Schema = SCHEMA, uid: str | None = None) -> TableSpec:
    return TableSpec(name, uid or uuid.uuid4().hex, schema, "replicated")


def test_catalog_finds_tables_by_duckdbs_rule_and_keeps_their_spelling() -> None:
    catalog = Catalog().with_table(_spec("LineItem")).with_table(_spec("Straße"))
    assert catalog.find_table("lineitem") is catalog.find_table("LINEITEM") is not None
    assert catalog.table("LINEITEM").name == "LineItem"
    assert catalog.find_table("STRASSE") is None and catalog.find_table("STRAßE") is not None
    assert catalog.find_table("nope") is None
    with pytest.raises(KeyError):
        catalog.table("nope")
    assert "LineItem" not in catalog.without_table("LINEITEM").tables
    spec = catalog.table("lineitem")
    assert spec.find_column("v") == spec.schema.field("V") and spec.find_column("w") is None


def test_catalog_refuses_a_second_table_of_the_same_name() -> None:
    first = _spec("lineitem")
    catalog = Catalog().with_table(first)
    with pytest.raises(TableExistsError, match="LINEITEM"):
        catalog.with_table(_spec("LINEITEM"))
    with pytest.raises(TableExistsError):
        catalog.with_table(_spec("lineitem"))
    # a newer spec of the same table replaces it
    updated = catalog.with_table(TableSpec("lineitem", first.uid, SCHEMA, "replicated", rows=5))
    assert updated.table("lineitem").rows == 5 and len(updated.tables) == 1
    # names DuckDB tells apart are different tables
    assert len(catalog.with_table(_spec("Äpfel")).with_table(_spec("äpfel")).tables) == 3


def test_catalog_refuses_columns_of_the_same_name() -> None:
    schema = pa.schema([("col", pa.int64()), ("COL", pa.int64())])
    with pytest.raises(TableError, match="COL"):
        Catalog().with_table(_spec("t", schema))
    ok = pa.schema([("Straße", pa.int64()), ("STRASSE", pa.int64())])
    assert Catalog().with_table(_spec("t", ok)).table("t").schema == ok
