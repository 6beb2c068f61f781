"""The main job: TPC-H on a local shardflow cluster beside DuckDB on the same data, and the
live scaling story (:mod:`shardflow.tools.story`) on that cluster."""

from __future__ import annotations

import math
import shutil
import statistics
import time
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from shardflow import tpch
from shardflow.api import Database, connect
from shardflow.records import NodeInfo
from shardflow.telemetry.calibration import best_of
from shardflow.tools import story
from shardflow.tools.story import StorySummary


@dataclass(frozen=True)
class QueryTiming:
    query: int
    shardflow_s: float
    duckdb_s: float
    plan: str
    worker_share: float
    rows: int
    matches: bool

    @property
    def ratio(self) -> float:
        return self.shardflow_s / self.duckdb_s


def _rounded(value: Any) -> Any:
    if isinstance(value, float | Decimal):
        number = float(value)
        return round(number, 6 - math.floor(math.log10(abs(number))) if number else 0)
    return value


def same_rows(left: pa.Table, right: pa.Table) -> bool:
    """Equal as multisets of rows, numbers compared to about 7 significant digits."""
    if left.shape != right.shape:
        return False

    def rows(table: pa.Table) -> list[tuple[Any, ...]]:
        values = [tuple(_rounded(v) for v in row.values()) for row in table.to_pylist()]
        return sorted(values, key=lambda row: tuple((v is None, str(v)) for v in row))

    return rows(left) == rows(right)


@dataclass(frozen=True)
class DemoResult:
    timings: list[QueryTiming]
    story: StorySummary | None

    @property
    def ok(self) -> bool:
        answers = all(t.matches for t in self.timings)
        return answers and (self.story is None or self.story.ok)


def run_demo(
    sf: float = 0.1,
    workers: int = 4,
    repeat: int = 3,
    home: Path = Path(".shardflow-demo"),
    console: Console | None = None,
    *,
    live: bool = True,
    story: bool = True,
    pace_s: float = 3.0,
) -> DemoResult:
    """Load TPC-H into a local cluster, time the 22 queries beside DuckDB, then (``story``)
    change the cluster live under checked readers and an inserter; print both."""
    console = console or Console()
    with console.status(f"generating TPC-H at scale factor {sf:g}"):
        data = tpch.generate(sf, home / "tpch")
    console.print(f"TPC-H SF {sf:g} in {data}")
    db_dir = home / f"db-sf{sf:g}"
    shutil.rmtree(db_dir, ignore_errors=True)  # a fresh load every run
    with console.status(f"starting {workers} local workers"):
        db = connect(workers=workers, data_dir=db_dir, auto_balance=False)
    assert isinstance(db, Database)  # embedded, never a remote service
    summary = None
    with db:
        started = time.perf_counter()
        tpch.load(db, data, progress=True)
        console.print(f"loaded 8 tables in {time.perf_counter() - started:.1f}s")
        console.print(render_nodes(db.cluster.nodes()))
        oracle = tpch.duckdb_oracle(data)
        timings, expected = time_queries(db, oracle, repeat, console)
        if story:
            summary = tell_story(db, oracle, expected, console, live=live, pace_s=pace_s, sf=sf)
    console.print(render(timings, sf, workers))
    if summary is not None:
        console.print(summary.table())
        console.print(summary.line(), markup=False, highlight=False, soft_wrap=True)
        for failure in summary.failures:
            console.print(f"  {failure}", markup=False, highlight=False, style="red")
    return DemoResult(timings, summary)


def time_queries(
    db: Database, oracle: duckdb.DuckDBPyConnection, repeat: int, console: Console
) -> tuple[list[QueryTiming], dict[int, pa.Table]]:
    """Each TPC-H query on the cluster and in DuckDB (best of ``repeat``), answers compared;
    returns the timings and DuckDB's answers."""
    timings = []
    expected: dict[int, pa.Table] = {}
    with Progress(*Progress.get_default_columns(), console=console, transient=True) as bar:
        task = bar.add_task("timing the 22 TPC-H queries beside DuckDB", total=22)
        for number, query in tpch.queries().items():
            answer = db.sql(query)  # warm: plan cached, answer checked against DuckDB
            report = db.last_report
            expected[number] = oracle.sql(query).to_arrow_table()
            ours = best_of(repeat, partial(db.sql, query))
            theirs = best_of(repeat, partial(_duckdb_answer, oracle, query))
            assert report is not None
            timings.append(
                QueryTiming(
                    number,
                    ours,
                    theirs,
                    report.pushdown,
                    report.worker_share,
                    answer.num_rows,
                    same_rows(answer, expected[number]),
                )
            )
            bar.advance(task)
    return timings, expected


LOOKUPS = 50
"""Order keys the point-lookup reader cycles through."""


def tell_story(
    db: Database,
    oracle: duckdb.DuckDBPyConnection,
    expected: dict[int, pa.Table],
    console: Console,
    *,
    live: bool,
    pace_s: float,
    sf: float,
) -> StorySummary:
    """The live scaling story (``shardflow.tools.story``) over the loaded TPC-H tables."""
    db.create_table(
        story.EVENTS,
        pa.table({"id": pa.array([], pa.int64()), "amount": pa.array([], pa.int64())}),
        distributed_by="id",
    )
    keys = oracle.sql(
        f"SELECT o_orderkey FROM orders ORDER BY hash(o_orderkey) LIMIT {LOOKUPS}"
    ).to_arrow_table()
    lookups = {
        key: oracle.sql(story.LOOKUP_SQL, params=[key]).to_arrow_table()
        for key in keys.column(0).to_pylist()
    }
    checked = {f"Q{n:02d}": (tpch.query(n), answer) for n, answer in expected.items()}
    clients = story.Clients(db, checked, lookups, same_rows)
    title = f"shardflow: live scaling under load (TPC-H SF {sf:g})"
    return story.Story(db, clients, console, live=live, pace_s=pace_s, title=title).run()


def render_nodes(nodes: list[NodeInfo]) -> Table:
    """The workers: their device, engine, calibrated capacity and what they hold."""
    table = Table(title="workers")
    for column in ("node", "device", "engine", "capacity", "shards", "rows", "MiB"):
        table.add_column(
            column, justify="left" if column in ("node", "device", "engine") else "right"
        )
    for node in sorted(nodes, key=lambda n: n.node_id):
        table.add_row(
            node.node_id,
            f"{node.vendor}: {node.model}",
            node.engine,
            f"{node.capacity:.2f}",
            str(node.shards),
            f"{node.rows:,}",
            f"{node.bytes / (1 << 20):.1f}",
        )
    return table


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def render(timings: list[QueryTiming], sf: float, workers: int) -> Table:
    table = Table(title=f"TPC-H SF {sf:g}: shardflow ({workers} workers) vs DuckDB")
    for column in (
        "query",
        "shardflow ms",
        "DuckDB ms",
        "ratio",
        "pushdown",
        "on workers",
        "rows",
        "same answer",
    ):
        table.add_column(column, justify="right" if column != "pushdown" else "left")
    for t in timings:
        table.add_row(
            f"Q{t.query:02d}",
            f"{t.shardflow_s * 1000:.1f}",
            f"{t.duckdb_s * 1000:.1f}",
            f"{t.ratio:.2f}",
            t.plan,
            f"{t.worker_share:.0%}",
            str(t.rows),
            "yes" if t.matches else "NO",
        )
    table.caption = (
        f"geometric mean ratio shardflow/DuckDB: {geomean([t.ratio for t in timings]):.2f}; "
        f"answers equal: {sum(t.matches for t in timings)}/{len(timings)}"
    )
    return table


def _duckdb_answer(con: duckdb.DuckDBPyConnection, query: str) -> pa.Table:
    return con.sql(query).to_arrow_table()
