"""Tests for shardflow.tpch: query texts, Parquet generation and the DuckDB oracle (no Ray)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
import sqlglot

from shardflow import tpch


@pytest.fixture(scope="module")
def sf001_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tpch.generate(0.01, tmp_path_factory.mktemp("tpch"))


@pytest.fixture(scope="module")
def oracle(sf001_dir: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    con = tpch.duckdb_oracle(sf001_dir)
    yield con
    con.close()


def test_tables_and_layout() -> None:
    assert len(tpch.TABLES) == 8
    assert set(tpch.TABLES) == {t.name for t in tpch.LAYOUT}
    assert [t.name for t in tpch.LAYOUT[:2]] == ["lineitem", "orders"]
    lineitem, orders, *rest = tpch.LAYOUT
    assert lineitem.distributed_by == "l_orderkey" and not lineitem.replicated
    assert orders.distributed_by == "o_orderkey" and orders.colocate_with == "lineitem"
    assert all(t.replicated and t.distributed_by is None for t in rest)


def test_queries_parse() -> None:
    qs = tpch.queries()
    assert sorted(qs) == list(range(1, 23))
    for n, sql in qs.items():
        assert sql == tpch.query(n)
        assert not sql.rstrip().endswith(";")
        assert sqlglot.parse_one(sql, dialect="duckdb") is not None
    assert "limit 100" in qs[2].lower()
    assert qs[15].lower().lstrip().startswith("with revenue0 as")


@pytest.mark.parametrize("bad", [0, 23, -1])
def test_query_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError):
        tpch.query(bad)


def test_generate_and_reuse(tmp_path: Path) -> None:
    data_dir = tpch.generate(0.01, tmp_path)
    assert data_dir == tmp_path / "sf0.01"
    paths = tpch.table_paths(data_dir)
    assert sorted(paths) == sorted(tpch.TABLES)
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert sorted(p.name for p in data_dir.iterdir()) == sorted(f"{t}.parquet" for t in tpch.TABLES)
    # Nothing but the finished folder is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["sf0.01"]

    before = {t: (p.stat().st_mtime_ns, p.stat().st_ino) for t, p in paths.items()}
    again = tpch.generate(0.01, tmp_path)
    assert again == data_dir
    after = {t: (p.stat().st_mtime_ns, p.stat().st_ino) for t, p in paths.items()}
    assert after == before


def test_generate_without_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="tpchgen-cli"):
        tpch.generate(0.01, tmp_path / "out")
    assert not (tmp_path / "out" / "sf0.01").exists()


def test_oracle_tables(oracle: duckdb.DuckDBPyConnection) -> None:
    counts = {
        t: oracle.execute(f"select count(*) from {t}").fetchone()[0]  # type: ignore[index]
        for t in tpch.TABLES
    }
    assert counts["nation"] == 25
    assert counts["region"] == 5
    assert counts["orders"] == 15_000
    assert counts["lineitem"] > counts["orders"]


@pytest.mark.parametrize("n", range(1, 23))
def test_query_runs_on_oracle(oracle: duckdb.DuckDBPyConnection, n: int) -> None:
    rows = oracle.execute(tpch.query(n)).fetchall()
    assert isinstance(rows, list)


def test_load_makes_the_tables_named_in_the_layouts_order(sf001_dir: Path) -> None:
    made: list[tuple[str, Path, dict[str, object]]] = []

    class Recorder:  # what load asks of a database: create_table calls, in order
        def create_table(self, name: str, source: Path, **options: object) -> None:
            made.append((name, source, options))

    tpch.load(Recorder(), sf001_dir, tables=("orders", "lineitem"))
    assert [name for name, _, _ in made] == ["lineitem", "orders"]  # co-located after
    assert made[1][1] == tpch.table_paths(sf001_dir)["orders"]
    assert made[1][2]["colocate_with"] == "lineitem"
    made.clear()
    tpch.load(Recorder(), sf001_dir)
    assert [name for name, _, _ in made] == [t.name for t in tpch.LAYOUT]
