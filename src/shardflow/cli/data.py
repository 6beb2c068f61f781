"""The data commands: the demo, SQL, loads and inserts, plans, tables and profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pyarrow as pa
import typer

from shardflow.cli.common import (
    Address,
    DataDir,
    Format,
    FormatOption,
    Token,
    User,
    Workers,
    app,
    connect_to,
    console,
    write,
)
from shardflow.errors import TableError


@app.command()
def demo(
    sf: Annotated[float, typer.Option(min=0.001, help="TPC-H scale factor.")] = 0.1,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Local workers to start.")] = 4,
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs per query (best).")] = 3,
    home: Annotated[Path, typer.Option(help="Where data is generated and loaded.")] = Path(
        ".shardflow-demo"
    ),
    live: Annotated[
        bool | None,
        typer.Option(
            "--live/--no-live",
            help="One live screen for the scaling story, or plain lines (CI logs). "
            "Default: live on a terminal.",
        ),
    ] = None,
    story: Annotated[
        bool,
        typer.Option(help="After the timings, change the cluster live under checked load."),
    ] = True,
    pace: Annotated[
        float, typer.Option(min=0.1, help="Seconds of steady load between the story's steps.")
    ] = 3.0,
) -> None:
    """Generate TPC-H, load it into a local cluster, run the 22 queries beside DuckDB; then
    add nodes, move, split, drain and kill while checked readers and an inserter run."""
    from shardflow.tools.demo import run_demo

    result = run_demo(
        sf=sf,
        workers=workers,
        repeat=repeat,
        home=home,
        console=console,
        live=console.is_terminal if live is None else live,
        story=story,
        pace_s=pace,
    )
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def sql(
    query: str,
    data_dir: DataDir = Path(".shardflow"),
    address: Address = None,
    user: User = None,
    token: Token = None,
    form: Annotated[
        Format,
        typer.Option(
            "--format",
            help="table (first 50 rows), or every row as csv, json lines or an arrow stream.",
        ),
    ] = Format.table,
) -> None:
    """Run one query, or one statement that changes tables (INSERT INTO ... SELECT |
    VALUES, UPDATE, DELETE, CREATE TABLE ... AS SELECT, TRUNCATE, DROP TABLE), against the
    tables in a data directory."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
        write(db.sql(query), form)


@app.command()
def load(
    name: Annotated[str, typer.Argument(help="The new table's name.")],
    path: Annotated[str, typer.Argument(help="A Parquet file or directory (path or URI).")],
    distributed_by: Annotated[
        str | None, typer.Option(help="Hash rows on this column into shards.")
    ] = None,
    colocate_with: Annotated[
        str | None, typer.Option(help="Keep equal bucket ranges with this table's.")
    ] = None,
    replicated: Annotated[bool, typer.Option(help="A copy on every worker.")] = False,
    key_index: Annotated[
        bool, typer.Option(help="Index the distribution column in every shard (point lookups).")
    ] = False,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Create a table from Parquet and load it (durable once this returns)."""
    if "://" not in path and not Path(path).exists():  # said before any cluster starts
        raise TableError(f"source {path!r} does not exist")
    console.print(f"loading {name} from {path} ({_rows_in(path)})", highlight=False)
    with connect_to(data_dir, address, workers, creates=True, user=user, token=token) as db:
        rows = db.create_table(
            name,
            path,
            distributed_by=distributed_by,
            colocate_with=colocate_with,
            replicated=replicated,
            key_index=key_index,
            progress=console.is_terminal,
        )
    console.print(f"loaded {rows} rows into {name}")


@app.command()
def insert(
    name: Annotated[str, typer.Argument(help="The table to insert into.")],
    path: Annotated[str, typer.Argument(help="A Parquet file or directory of new rows.")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Insert the rows of a Parquet file into a table (acknowledged once durable)."""
    import pyarrow.dataset as ds

    try:
        rows = ds.dataset(path, format="parquet").to_table()
    except (OSError, pa.ArrowException) as error:
        raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        count = db.insert(name, rows)
    console.print(f"inserted {count} rows into {name}")


@app.command()
def drop(
    name: Annotated[str, typer.Argument(help="The table to drop.")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Drop a table: its rows and files are gone once this returns."""
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        db.drop_table(name)
    console.print(f"dropped {name}")


@app.command()
def explain(
    query: str,
    data_dir: DataDir = Path(".shardflow"),
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Show where each part of a query would run."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
        console.print(db.explain(query), markup=False, highlight=False)


@app.command()
def tables(
    data_dir: DataDir = Path(".shardflow"),
    address: Address = None,
    user: User = None,
    token: Token = None,
    form: FormatOption = Format.table,
) -> None:
    """List the tables in a data directory: kind, key, shards (a replicated table's copies),
    rows, columns."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
        write(db.tables(), form)


@app.command()
def profile(
    query: str,
    html: Annotated[
        Path | None, typer.Option(help="Write the timeline page (one lane per worker) here.")
    ] = None,
    data_dir: DataDir = Path(".shardflow"),
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Run a query and show where its time went: planning, and per fragment the worker,
    device, engine, queue wait, execution, rows and bytes, transfer; and the merges."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
        result, found = db.profile(query)
    console.print(found.text(), markup=False, highlight=False)
    console.print(f"{result.num_rows} rows")
    if html is not None:
        html.write_text(found.html(), encoding="utf-8")
        console.print(f"timeline written to {html}")


def _rows_in(path: str) -> str:
    """How many rows a Parquet source holds, from its footers (said at once: a big load's
    first output is not its end)."""
    import pyarrow.dataset as ds

    try:
        return f"{ds.dataset(path, format='parquet').count_rows():,} rows"
    except (OSError, pa.ArrowException) as error:
        raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
