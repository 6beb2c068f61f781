"""The ``shardflow`` command: the demo, and SQL against a data directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pyarrow as pa
import typer
from rich.console import Console
from rich.table import Table

from shardflow.errors import Error

app = typer.Typer(
    help="shardflow: distributed SQL over sharded Arrow tables on Ray.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
if not console.is_terminal:
    console.width = 120  # piped output (CI logs): wide enough for the demo's table

DataDir = Annotated[Path, typer.Option(help="Data directory (catalog and table files).")]
Workers = Annotated[int, typer.Option(min=1, max=64, help="Local workers to start.")]


@app.command()
def demo(
    sf: Annotated[float, typer.Option(min=0.001, help="TPC-H scale factor.")] = 0.1,
    workers: Workers = 4,
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs per query (best).")] = 3,
    home: Annotated[Path, typer.Option(help="Where data is generated and loaded.")] = Path(
        ".shardflow-demo"
    ),
) -> None:
    """Generate TPC-H, load it into a local cluster, run the 22 queries beside DuckDB."""
    from shardflow.demo import run_demo

    timings = run_demo(sf=sf, workers=workers, repeat=repeat, home=home, console=console)
    if not all(t.matches for t in timings):
        raise typer.Exit(1)


def _print_table(table: pa.Table, limit: int = 50) -> None:
    view = Table(*table.column_names)
    for row in table.slice(0, limit).to_pylist():
        view.add_row(*("NULL" if v is None else str(v) for v in row.values()))
    console.print(view)
    if table.num_rows > limit:
        console.print(f"... {table.num_rows - limit} more rows")


def _connect(data_dir: Path, workers: int):  # type: ignore[no-untyped-def]
    from shardflow.api import connect

    return connect(workers=workers, data_dir=data_dir)


@app.command()
def sql(query: str, data_dir: DataDir = Path(".shardflow"), workers: Workers = 4) -> None:
    """Run one query against the tables in a data directory."""
    with _connect(data_dir, workers) as db:
        _print_table(db.sql(query))


@app.command()
def explain(query: str, data_dir: DataDir = Path(".shardflow"), workers: Workers = 1) -> None:
    """Show where each part of a query would run."""
    with _connect(data_dir, workers) as db:
        console.print(db.explain(query), markup=False, highlight=False)


@app.command()
def tables(data_dir: DataDir = Path(".shardflow"), workers: Workers = 1) -> None:
    """List the tables in a data directory."""
    with _connect(data_dir, workers) as db:
        _print_table(db.tables())


def main() -> None:
    try:
        app()
    except Error as error:
        console.print(f"[red]error:[/red] {type(error).__name__}: {error}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
