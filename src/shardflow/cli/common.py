"""What every command group shares: the ``shardflow`` app, the console, the options data
commands take, result output, and reaching the cluster of a data directory."""

from __future__ import annotations

import enum
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import pyarrow as pa
import typer
from rich.console import Console
from rich.table import Table

from shardflow.errors import ConfigError, DataDirInUseError

if TYPE_CHECKING:
    from shardflow.api import Database
    from shardflow.flightsql.client import RemoteDatabase
    from shardflow.tools.localcluster import LocalRayCluster

    Client = Database | RemoteDatabase
    """What a data command works on: a cluster, or a service over Flight SQL."""

FLIGHT_SCHEMES = ("grpc://", "grpc+tcp://", "grpc+tls://")

app = typer.Typer(
    help="shardflow: distributed SQL over sharded Arrow tables on Ray.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
if not console.is_terminal:  # piped output (CI logs): wide enough for the demo's table,
    console.width = max(120, console.width)  # wider where COLUMNS says so
status = Console(stderr=True)
"""Progress while something starts: on standard error, so that results on standard output
stay clean for scripts."""

DataDir = Annotated[Path, typer.Option(help="Data directory (catalog and table files).")]
Workers = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=64,
        help="Workers to start when no cluster serves the data directory (default: as many as "
        "it last had, else 4).",
    ),
]
ServiceDir = Annotated[Path, typer.Option(help="Data directory the service serves.")]
Address = Annotated[
    str | None,
    typer.Option(
        help="A running cluster: a Flight SQL service (grpc://host:port, with --user or "
        "--token) or a Ray cluster (host:port). Default: the one serving the data directory, "
        "else one started for this command."
    ),
]
User = Annotated[
    str | None,
    typer.Option(
        envvar="SHARDFLOW_USER",
        help="A user of the service at --address grpc://...; the password is read from "
        "SHARDFLOW_PASSWORD, else asked for.",
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        envvar="SHARDFLOW_TOKEN",
        show_default=False,
        help="A service token for --address grpc://..., instead of --user.",
    ),
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


def write(table: pa.Table, form: Format, fit: bool = False) -> None:
    """A result on standard output: a rich table for people; CSV, JSON lines or an Arrow
    IPC stream (every row, exact types) for scripts. ``fit``: see :func:`print_table`."""
    if form is Format.table:
        print_table(table, fit=fit)
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


def print_table(table: pa.Table, limit: int = 50, fit: bool = False) -> None:
    """The first ``limit`` rows as a table for people. With ``fit`` a row stays one line
    however narrow the terminal: long cells are cut short (…), not wrapped (the full values:
    ``--format csv`` or ``json``)."""
    view = Table(*table.column_names)
    if fit:
        for column in view.columns:
            column.no_wrap = True
            column.overflow = "ellipsis"
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


def connect_to(
    data_dir: Path,
    address: str | None,
    workers: int | None = None,
    *,
    looks: bool = False,
    creates: bool = False,
    user: str | None = None,
    token: str | None = None,
) -> Client:
    """Attach to the cluster serving ``data_dir`` — the Flight SQL service or Ray cluster
    at ``address``, or the local cluster of ``shardflow cluster up`` when it runs there
    (fast) — else open it in this process for the command: the cluster the data
    directory last had (its nodes under their ids, so no shard moves), or ``workers`` for a
    new one. A command that only ``looks`` starts it exactly as it was, without a balancer;
    one that ``creates`` (a load) may start on a new data directory, any other refuses a
    directory that holds no shardflow data."""
    if address is not None and address.startswith(FLIGHT_SCHEMES):
        return service(address, user, token)
    if user is not None or token is not None:
        raise ConfigError("--user and --token are for a service: --address grpc://host:port")
    if address is None and local_cluster(data_dir).running:
        address = local_cluster(data_dir).address
    if address is not None:  # attach to the service serving data_dir there
        return attach(address, data_dir)
    served = flight_service_of(data_dir)
    if served is not None:  # an embedded cluster owns it: its Flight door is the way in
        raise DataDirInUseError(
            f"{data_dir.absolute()} is served by `shardflow serve` (pid {served['pid']}): "
            f"give --address {served['location']} with --user NAME (the password from "
            "SHARDFLOW_PASSWORD) or --token"
        )
    if not creates:
        require_data(data_dir)
    # A command's own cluster lives as long as the command: in this process, without the
    # seconds a Ray start takes (the same coordinator and workers, over the same files).
    with status.status(f"opening {data_dir}"):
        if looks:  # looking never moves data
            return in_process(data_dir, auto_balance=False)
        return in_process(data_dir, workers=workers)


def in_process(data_dir: Path, **options: Any) -> Database:
    """The cluster of ``data_dir`` in this process, for one command."""
    from shardflow.api import Database, connect

    db = connect(data_dir=data_dir, in_process=True, **options)
    assert isinstance(db, Database)  # no address: never a remote service
    return db


def service(address: str, user: str | None, token: str | None) -> RemoteDatabase:
    """The Flight SQL service at ``address``, as ``user`` (password from
    ``SHARDFLOW_PASSWORD``, else asked for) or with a service ``token``."""
    from shardflow.flightsql.client import RemoteDatabase  # not the API: no Ray to import

    if user is None and token is None:
        raise ConfigError(
            f"{address} is a Flight SQL service: give --user NAME (the password from "
            "SHARDFLOW_PASSWORD, else asked for) or --token (or SHARDFLOW_TOKEN)"
        )
    password = None
    if user is not None:
        password = os.environ.get("SHARDFLOW_PASSWORD") or typer.prompt(
            f"Password of {user}", hide_input=True, err=True
        )
    return RemoteDatabase(address, user=user, password=password, token=token)


SERVICE_FILE = "flight-service.json"
"""Where ``shardflow serve`` says, in the data directory it serves, where its Flight SQL
door is (while it runs)."""


def flight_service_of(data_dir: Path) -> dict[str, Any] | None:
    """Where the running ``shardflow serve`` of ``data_dir`` takes Flight SQL calls, and its
    pid; None where none runs."""
    from shardflow.catalog.lease import process_running

    try:
        served: dict[str, Any] = json.loads((data_dir / SERVICE_FILE).read_text())
    except (OSError, ValueError):
        return None
    pid = served.get("pid")
    if not isinstance(pid, int) or not process_running(pid):
        return None
    return served


def require_data(data_dir: Path) -> None:
    """Refuse a data directory that holds no shardflow data (a typo must not start an empty
    cluster in a new folder)."""
    catalog = data_dir / "catalog"
    if not catalog.is_dir() or not any(catalog.glob("*.json")):
        where = data_dir.absolute()
        raise ConfigError(
            f"{where} holds no shardflow data (no catalog): check --data-dir; "
            "`shardflow load` creates a table in a new one"
        )


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
