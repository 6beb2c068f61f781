"""What every command group shares: the ``shardflow`` app, the console, the options data
commands take, result output, and reaching the cluster of a data directory."""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import pyarrow as pa
import typer
from rich.console import Console
from rich.table import Table

from shardflow.errors import ConfigError

if TYPE_CHECKING:
    from shardflow.api import Database
    from shardflow.tools.localcluster import LocalRayCluster

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
ServiceDir = Annotated[Path, typer.Option(help="Data directory the service serves.")]
Address = Annotated[
    str | None,
    typer.Option(help="A running service's Ray address (host:port); default: start locally."),
]
Sets = Annotated[
    list[str] | None,
    typer.Option("--set", help="A setting for the service, name=value (repeatable)."),
]


class Format(enum.StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    arrow = "arrow"


FormatOption = Annotated[
    Format,
    typer.Option("--format", help="table, or every row as csv, json lines or an arrow stream."),
]


def write(table: pa.Table, form: Format) -> None:
    """A result on standard output: a rich table for people; CSV, JSON lines or an Arrow
    IPC stream (every row, exact types) for scripts."""
    if form is Format.table:
        print_table(table)
        return
    out = sys.stdout.buffer
    if form is Format.csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, out)
    elif form is Format.json:
        for row in table.to_pylist():
            out.write(json.dumps(row, default=str).encode() + b"\n")
    else:
        with pa.ipc.new_stream(out, table.schema) as stream:
            stream.write_table(table)
    out.flush()


def print_table(table: pa.Table, limit: int = 50) -> None:
    view = Table(*table.column_names)
    for row in table.slice(0, limit).to_pylist():
        view.add_row(*("NULL" if v is None else str(v) for v in row.values()))
    console.print(view)
    if table.num_rows > limit:
        console.print(f"... {table.num_rows - limit} more rows")


def ray_database(address: str | None, data_dir: Path, **options: Any) -> Database:
    """``connect()`` to the cluster of ``data_dir``: embedded, or on the Ray cluster at
    ``address`` (a Ray address, not a Flight one)."""
    from shardflow.api import Database, connect

    db = connect(address=address, data_dir=data_dir, **options)
    if not isinstance(db, Database):
        db.close()
        raise ConfigError(f"{address} is a Flight SQL address; this needs a Ray address")
    return db


def connect_to(data_dir: Path, workers: int, address: str | None) -> Database:
    """Attach to the cluster serving ``data_dir`` — at ``address``, or the local cluster of
    ``shardflow cluster up`` when it runs there (fast) — else start an embedded one."""
    if address is None and local_cluster(data_dir).running:
        address = local_cluster(data_dir).address
    if address is not None:  # attach to the service serving data_dir there
        return attach(address, data_dir)
    return ray_database(None, data_dir, workers=workers)


def attach(address: str, data_dir: Path) -> Database:
    """The running service of ``data_dir`` at ``address`` (never a new one)."""
    from shardflow.runtime.ray.bootstrap import require_service

    require_service(address, str(data_dir.absolute()))
    return ray_database(address, data_dir)


def start_service(
    address: str, data_dir: Path, workers: int | None, assignments: list[str] | None
) -> None:
    """Start shardflow on the Ray cluster at ``address`` and leave it running."""
    from shardflow.config import Settings

    settings = Settings().with_text(assignments or [])
    db = ray_database(address, data_dir, workers=workers, settings=settings)
    try:
        db.keep_running()  # detached: it keeps serving after this process
        count = len(db.cluster.nodes())
    finally:
        db.close()
    console.print(f"shardflow serves {data_dir.absolute()} on {address} with {count} worker(s)")
    console.print(
        f'connect with: shardflow.connect(address="{address}", data_dir="{data_dir.absolute()}")'
    )


def local_cluster(data_dir: Path) -> LocalRayCluster:
    from shardflow.tools.localcluster import LocalRayCluster

    return LocalRayCluster(data_dir)
