"""The ``shardflow`` command: the demo, and SQL against a data directory."""

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
from rich.text import Text

from shardflow.errors import ConfigError, Error

if TYPE_CHECKING:
    from shardflow.service.auth import AuthStore

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
    from shardflow.demo import run_demo

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


class Format(enum.StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    arrow = "arrow"


def _write(table: pa.Table, form: Format) -> None:
    """A result on standard output: a rich table for people; CSV, JSON lines or an Arrow
    IPC stream (every row, exact types) for scripts."""
    if form is Format.table:
        _print_table(table)
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


def _print_table(table: pa.Table, limit: int = 50) -> None:
    view = Table(*table.column_names)
    for row in table.slice(0, limit).to_pylist():
        view.add_row(*("NULL" if v is None else str(v) for v in row.values()))
    console.print(view)
    if table.num_rows > limit:
        console.print(f"... {table.num_rows - limit} more rows")


Address = Annotated[
    str | None,
    typer.Option(help="A running service's Ray address (host:port); default: start locally."),
]


def _connect(data_dir: Path, workers: int, address: str | None):  # type: ignore[no-untyped-def]
    """Attach to the cluster serving ``data_dir`` — at ``address``, or the local cluster of
    ``shardflow cluster up`` when it runs there (fast) — else start an embedded one."""
    from shardflow.api import connect

    if address is None and _local(data_dir).running:
        address = _local(data_dir).address
    if address is not None:  # attach to the service serving data_dir there
        return _attach(address, data_dir)
    return connect(workers=workers, data_dir=data_dir)


@app.command()
def sql(
    query: str,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
    form: Annotated[
        Format,
        typer.Option(
            "--format",
            help="table (first 50 rows), or every row as csv, json lines or an arrow stream.",
        ),
    ] = Format.table,
) -> None:
    """Run one query against the tables in a data directory."""
    with _connect(data_dir, workers, address) as db:
        _write(db.sql(query), form)


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
    workers: Workers = 4,
    address: Address = None,
) -> None:
    """Create a table from Parquet and load it (durable once this returns)."""
    with _connect(data_dir, workers, address) as db:
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
    workers: Workers = 4,
    address: Address = None,
) -> None:
    """Insert the rows of a Parquet file into a table (acknowledged once durable)."""
    import pyarrow.dataset as ds

    from shardflow.errors import TableError

    try:
        rows = ds.dataset(path, format="parquet").to_table()
    except (OSError, pa.ArrowException) as error:
        raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
    with _connect(data_dir, workers, address) as db:
        count = db.insert(name, rows)
    console.print(f"inserted {count} rows into {name}")


@app.command()
def explain(
    query: str,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 1,
    address: Address = None,
) -> None:
    """Show where each part of a query would run."""
    with _connect(data_dir, workers, address) as db:
        console.print(db.explain(query), markup=False, highlight=False)


@app.command()
def tables(
    data_dir: DataDir = Path(".shardflow"), workers: Workers = 1, address: Address = None
) -> None:
    """List the tables in a data directory."""
    with _connect(data_dir, workers, address) as db:
        _print_table(db.tables())


FormatOption = Annotated[
    Format,
    typer.Option("--format", help="table, or every row as csv, json lines or an arrow stream."),
]


@app.command()
def profile(
    query: str,
    html: Annotated[
        Path | None, typer.Option(help="Write the timeline page (one lane per worker) here.")
    ] = None,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
) -> None:
    """Run a query and show where its time went: planning, and per fragment the worker,
    device, engine, queue wait, execution, rows and bytes, transfer; and the merges."""
    with _connect(data_dir, workers, address) as db:
        result, found = db.profile(query)
    console.print(found.text(), markup=False, highlight=False)
    console.print(f"{result.num_rows} rows")
    if html is not None:
        html.write_text(found.html(), encoding="utf-8")
        console.print(f"timeline written to {html}")


# -- a detached service and a local multi-node cluster ------------------------------------
cluster_app = typer.Typer(
    help="The cluster of a data directory — its nodes, shards and moves (attached to the "
    "one serving it, else an embedded one) — and a real multi-node Ray cluster on this "
    "machine (cluster up: each node its own processes, all on 127.0.0.1).",
    no_args_is_help=True,
)
app.add_typer(cluster_app, name="cluster")
ServiceDir = Annotated[Path, typer.Option(help="Data directory the service serves.")]


def _attach(address: str, data_dir: Path):  # type: ignore[no-untyped-def]
    """The running service of ``data_dir`` at ``address`` (never a new one)."""
    from shardflow.api import connect
    from shardflow.runtime.cluster import require_service

    require_service(address, str(data_dir.absolute()))
    return connect(address=address, data_dir=data_dir)


Sets = Annotated[
    list[str] | None,
    typer.Option("--set", help="A setting for the service, name=value (repeatable)."),
]


def _start_service(
    address: str, data_dir: Path, workers: int | None, assignments: list[str] | None
) -> None:
    """Start shardflow on the Ray cluster at ``address`` and leave it running."""
    from shardflow.api import connect
    from shardflow.config import Settings

    settings = Settings().with_text(assignments or [])
    db = connect(address=address, data_dir=data_dir, workers=workers, settings=settings)
    try:
        db._handle.owns_actors = False  # detached: it keeps serving after this process
        count = len(db.cluster.nodes())
    finally:
        db.close()
    console.print(f"shardflow serves {data_dir.absolute()} on {address} with {count} worker(s)")
    console.print(
        f'connect with: shardflow.connect(address="{address}", data_dir="{data_dir.absolute()}")'
    )


@app.command()
def serve(
    address: Annotated[
        str | None,
        typer.Option(help="The Ray cluster's address (host:port); none: an embedded one."),
    ] = None,
    data_dir: ServiceDir = Path(".shardflow"),
    workers: Annotated[
        int | None, typer.Option(min=1, max=64, help="Workers (default: one per Ray node).")
    ] = None,
    flight_port: Annotated[
        int | None,
        typer.Option(
            min=0, max=65535, help="Serve Arrow Flight SQL on this port (0: any free one)."
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address the Flight SQL server binds (loopback by default).")
    ] = "127.0.0.1",
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate: serve Flight SQL over TLS.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    insecure: Annotated[
        bool,
        typer.Option("--insecure", help="Allow a non-loopback --host without TLS."),
    ] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the running service.")] = False,
    operator_token_file: Annotated[
        Path | None,
        typer.Option(
            help="A file holding a service token (e.g. a mounted Kubernetes Secret) to accept "
            "as the operator-role token named 'k8s-operator'."
        ),
    ] = None,
    assignments: Sets = None,
) -> None:
    """Run shardflow as a service. With --flight-port, serve Arrow Flight SQL (ADBC, JDBC,
    pyarrow.flight, shardflow.connect("grpc://...")) until stopped (Ctrl-C, SIGTERM), on an
    embedded cluster or the Ray cluster at --address. With only --address, start a
    detached service there and return; connect(address=..., data_dir=...) attaches."""
    if stop:
        if address is None:
            raise typer.BadParameter("--stop needs --address")
        from shardflow.runtime.cluster import stop_service

        stopped = stop_service(address, str(data_dir.absolute()))
        console.print(f"stopped the service of {data_dir.absolute()} ({len(stopped)} node ids)")
        return
    if flight_port is None:
        if address is None:
            raise typer.BadParameter("give --flight-port, --address, or both")
        _start_service(address, data_dir, workers, assignments)
        return
    if operator_token_file is not None:
        _accept_operator_token(data_dir, operator_token_file)
    _serve_flight(address, data_dir, workers, assignments, flight_port, host, tls_cert, tls_key,
                  insecure)  # fmt: skip


OPERATOR_TOKEN_NAME = "k8s-operator"


def _accept_operator_token(data_dir: Path, path: Path) -> None:
    try:
        token = path.read_text().strip()
    except OSError as error:
        raise typer.BadParameter(f"cannot read --operator-token-file: {error}") from None
    _auth_store(data_dir).put_service_token(OPERATOR_TOKEN_NAME, "operator", token)


def _serve_flight(
    address: str | None,
    data_dir: Path,
    workers: int | None,
    assignments: list[str] | None,
    port: int,
    host: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    insecure: bool,
) -> None:
    from shardflow.api import connect
    from shardflow.config import Settings
    from shardflow.service.auth import AuthStore
    from shardflow.service.main import serve_flight, service_options

    settings = Settings().with_text(assignments or [])
    options = service_options(
        host, port, tls_cert, tls_key, insecure, settings.token_ttl_s, settings.max_request_mb << 20
    )
    if not AuthStore(data_dir).users() and not AuthStore(data_dir).service_tokens():
        console.print(
            "[yellow]no users yet: add one with shardflow user add NAME --role operator "
            f"--data-dir {data_dir} (the service reads them as they are added)"
        )
    with console.status("starting the cluster"):
        db = connect(address=address, data_dir=data_dir, workers=workers, settings=settings)
    try:
        if address is not None:
            db._handle.owns_actors = False  # the cluster keeps serving when this door closes

        def ready(server) -> None:  # type: ignore[no-untyped-def]
            console.print(f"shardflow serves {data_dir.absolute()}")
            print(f"Flight SQL on {server.location}", flush=True)  # one line, never wrapped

        serve_flight(db, str(data_dir.absolute()), options, ready)
    finally:
        db.close()
    console.print("Flight SQL service stopped")


def _local(data_dir: Path):  # type: ignore[no-untyped-def]
    from shardflow.runtime.localcluster import LocalRayCluster

    return LocalRayCluster(data_dir)


@cluster_app.command("nodes")
def cluster_nodes(
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
    form: FormatOption = Format.table,
) -> None:
    """Every node: device, engine, capacity, utilisation, health, shards, rows, bytes."""
    with _connect(data_dir, workers, address) as db:
        nodes = db.cluster.nodes()
    rows = [
        {
            "node": n.node_id,
            "alive": n.alive,
            "health": n.health,
            "device": f"{n.vendor} {n.model}".strip(),
            "engine": n.engine,
            "capacity": round(n.capacity, 3),
            "utilization": None if n.utilization is None else round(n.utilization, 3),
            "failure_rate": round(n.failure_rate, 4),
            "shards": n.shards,
            "rows": n.rows,
            "bytes": n.bytes,
            "ray_node": n.ray_node_name,
        }
        for n in nodes
    ]
    _write(pa.Table.from_pylist(rows), form)


@cluster_app.command("shards")
def cluster_shards(
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
    form: FormatOption = Format.table,
) -> None:
    """Every shard: its table, unit, bucket range, node, rows and bytes."""
    with _connect(data_dir, workers, address) as db:
        _write(db.cluster.shards(), form)


def _moves_table(records: list[Any]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "move": r.move_id,
                "kind": r.kind,
                "shards": ", ".join(r.shards),
                "from": ", ".join(r.from_nodes),
                "to": ", ".join(r.to_nodes),
                "phase": r.phase,
                "outcome": r.outcome,
                "seconds": round(r.seconds, 3),
                "bytes": r.bytes,
                "fence_ms": round(r.fence_seconds * 1000, 1),
                "reason": r.reason,
            }
            for r in records
        ]
    )


@cluster_app.command("migrations")
def cluster_migrations(
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
    form: FormatOption = Format.table,
) -> None:
    """The history of live moves: phase, outcome, time, bytes, the write fence, why."""
    with _connect(data_dir, workers, address) as db:
        _write(_moves_table(db.cluster.migrations()), form)


@cluster_app.command("migrate")
def cluster_migrate(
    shard: Annotated[str, typer.Argument(help="A shard (lineitem#3), as cluster shards lists.")],
    to: Annotated[str, typer.Argument(help="The node it moves to (node-2).")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
) -> None:
    """Move a shard (with every shard co-located with it) to another node, live."""
    with _connect(data_dir, workers, address) as db:
        with console.status(f"moving {shard} to {to}"):
            record = db.cluster.migrate(shard, to)
    _print_table(_moves_table([record]))


@cluster_app.command("drain")
def cluster_drain(
    node: Annotated[str, typer.Argument(help="A shardflow node (node-1).")],
    deadline: Annotated[float, typer.Option(help="Seconds the drain may take.")] = 300.0,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
) -> None:
    """Move every shard off a node live, then stop its worker."""
    with _connect(data_dir, workers, address) as db:
        with console.status(f"draining {node}"):
            moved = db.cluster.drain(node, deadline)
    console.print(f"drained {node}: {len(moved)} move(s)")
    if moved:
        _print_table(_moves_table(moved))


@cluster_app.command("rebalance")
def cluster_rebalance(
    apply: Annotated[
        bool, typer.Option("--apply", help="Carry the plan out (default: only show it).")
    ] = False,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = 4,
    address: Address = None,
) -> None:
    """What the balancer would do now (splits, merges and moves, with their reasons), or
    do it with --apply."""
    with _connect(data_dir, workers, address) as db:
        plan = db.cluster.rebalance(dry_run=not apply)
    console.print(f"{plan['reason']} (balanced by {plan['measure']})", markup=False)
    if plan["actions"]:
        rows = [
            {
                "action": a["action"],
                "units": ", ".join(str(u) for u in a.get("units", [a.get("unit")])),
                "to": a.get("to", ""),
                "reason": a["reason"],
            }
            for a in plan["actions"]
        ]
        _print_table(pa.Table.from_pylist(rows))
    if apply:
        console.print(f"{len(plan.get('moves', []))} move(s) done")


@cluster_app.command("up")
def cluster_up(
    nodes: Annotated[int, typer.Option(min=1, max=16, help="Data nodes to start.")] = 3,
    data_dir: ServiceDir = Path(".shardflow"),
    object_store_mb: Annotated[int, typer.Option(min=64, help="Object store per node.")] = 256,
    assignments: Sets = None,
) -> None:
    """Start a head node and NODES data nodes, then shardflow on them (one worker each)."""
    local = _local(data_dir)
    with console.status(f"starting {nodes + 1} Ray nodes on 127.0.0.1"):
        local.up(nodes, object_store_mb)
    console.print(f"Ray cluster up at {local.address}: head + {nodes} data nodes")
    try:
        with console.status("starting shardflow on it"):
            _start_service(local.address, data_dir, None, assignments)
    except BaseException:
        local.down()
        raise


@cluster_app.command("address")
def cluster_address(data_dir: ServiceDir = Path(".shardflow")) -> None:
    """Print the local cluster's Ray address (for connect(address=...))."""
    print(_local(data_dir).address)


@cluster_app.command("status")
def cluster_status(data_dir: ServiceDir = Path(".shardflow")) -> None:
    """Ray nodes, shardflow nodes and their shards, and health."""
    local = _local(data_dir)
    view = Table("Ray node", "pid", "process", "Ray node id")
    for node in local.nodes():
        name = node.name + (" (head)" if node.head else "")
        view.add_row(name, str(node.pid), "running" if node.alive else "gone", node.node_id[:12])
    console.print(view)
    with _attach(local.address, data_dir) as db:
        nodes = db.cluster.nodes()
        view = Table("node", "Ray node", "host", "alive", "shards", "rows", "engine")
        for info in nodes:
            view.add_row(
                info.node_id,
                info.ray_node_name or info.ray_node_id[:12],
                info.host,
                "yes" if info.alive else "NO",
                str(info.shards),
                str(info.rows),
                info.engine,
            )
        console.print(view)
        healthy = all(n.alive for n in nodes)
        console.print(f"health: {'ok' if healthy else 'degraded'} ({len(nodes)} nodes)")


@cluster_app.command("add-node")
def cluster_add_node(
    data_dir: ServiceDir = Path(".shardflow"),
    wait: Annotated[float, typer.Option(help="Seconds to wait for a worker on it.")] = 60.0,
) -> None:
    """Start one more data node; shardflow starts a worker on it (auto_join)."""
    import time

    local = _local(data_dir)
    node = local.add_node()
    console.print(f"Ray node {node.name} started ({node.node_id[:12]})")
    with _attach(local.address, data_dir) as db:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            joined = [n.node_id for n in db.cluster.nodes() if n.ray_node_id == node.node_id]
            if joined:
                console.print(f"shardflow node {', '.join(joined)} runs on {node.name}")
                return
            time.sleep(0.5)
    raise typer.Exit(1)


@cluster_app.command("remove-node")
def cluster_remove_node(
    node: Annotated[str, typer.Argument(help="A Ray node (ray-2) or a shardflow node (node-1).")],
    data_dir: ServiceDir = Path(".shardflow"),
    kill: Annotated[
        bool, typer.Option("--kill", help="SIGKILL every process of it, as a crash.")
    ] = False,
    deadline: Annotated[float, typer.Option(help="Seconds the drain may take.")] = 300.0,
) -> None:
    """Take a data node away: drained first (Ray drains it; shardflow moves its shards off
    live before the deadline), or killed outright."""
    import time

    local = _local(data_dir)
    with _attach(local.address, data_dir) as db:
        by_shardflow = {n.node_id: n.ray_node_name for n in db.cluster.nodes()}
        name = by_shardflow.get(node) or node
        target = local.node(name)
        if not kill:
            from shardflow.runtime.cluster import request_ray_drain

            request_ray_drain(target.node_id, deadline)
            ends = time.monotonic() + deadline
            with console.status(f"draining {name}"):
                while any(n.ray_node_id == target.node_id for n in db.cluster.nodes()):
                    if time.monotonic() > ends:
                        console.print(f"[red]{name} still serves shards after {deadline:g}s")
                        raise typer.Exit(1)
                    time.sleep(0.5)
            console.print(f"drained {name}: no shard is served there any more")
    local.remove_node(name, kill=kill)
    console.print(f"Ray node {name} {'killed' if kill else 'stopped'}")


@cluster_app.command("down")
def cluster_down(data_dir: ServiceDir = Path(".shardflow")) -> None:
    """Stop shardflow and every Ray node of the local cluster."""
    from shardflow.runtime.cluster import stop_service

    local = _local(data_dir)
    if local.running:
        try:
            stop_service(local.address, str(data_dir.absolute()))
        except Error as error:
            console.print(f"(shardflow was not running: {error})")
    local.down()
    console.print("local cluster stopped")


# -- accounts and the audit log of the network service -------------------------------------
# These read and write files under the data directory only: no Ray, no running service needed.
user_app = typer.Typer(help="Users of the Flight SQL service (name, role, password).")
token_app = typer.Typer(help="Service tokens: bearer tokens for machines, shown once.")
app.add_typer(user_app, name="user", no_args_is_help=True)
app.add_typer(token_app, name="token", no_args_is_help=True)
Role = Annotated[
    str, typer.Option(help="reader, writer or operator (each includes the ones before).")
]


def _auth_store(data_dir: Path) -> AuthStore:
    from shardflow.service.auth import AuthStore

    return AuthStore(data_dir)


@user_app.command("add")
def user_add(
    name: Annotated[str, typer.Argument(help="Login name: letters, digits and _.@- (1-64).")],
    role: Role,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="Read the password from standard input.")
    ] = False,
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Add a user; the password is asked for (twice), or read from standard input."""
    from shardflow.service.auth import check_role

    check_role(role)  # before asking for a password that would be refused anyway
    if password_stdin:
        text = sys.stdin.read()
        password = text.removesuffix("\n").removesuffix("\r")
    else:
        password = typer.prompt("Password", hide_input=True, confirmation_prompt=True)
    _auth_store(data_dir).add_user(name, role, password)
    console.print(f"added user {name} ({role})")


@user_app.command("list")
def user_list(data_dir: DataDir = Path(".shardflow")) -> None:
    """The users: name, role, when created."""
    view = Table("name", "role", "created")
    for user in _auth_store(data_dir).users():
        view.add_row(user["name"], user["role"], user["created"])
    console.print(view)


@user_app.command("remove")
def user_remove(
    name: Annotated[str, typer.Argument(help="The user to remove.")],
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Remove a user."""
    _auth_store(data_dir).remove_user(name)
    console.print(f"removed user {name}")


@token_app.command("create")
def token_create(
    role: Role,
    name: Annotated[str | None, typer.Option(help="The token's name (default: svc-<hex>).")] = None,
    ttl: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds it is valid (default: until revoked).")
    ] = None,
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Create a service token; the token is the last line printed (and only shown now)."""
    name, token = _auth_store(data_dir).create_service_token(role, name=name, ttl_s=ttl)
    console.print(
        f"service token {name} ({role}); store it now, it is shown only once:", highlight=False
    )
    print(token)  # alone on the last line, unwrapped: scripts capture it


@token_app.command("list")
def token_list(data_dir: DataDir = Path(".shardflow")) -> None:
    """The service tokens: name, role, created, expires (never the tokens themselves)."""
    from datetime import datetime

    view = Table("name", "role", "created", "expires")
    for token in _auth_store(data_dir).service_tokens():
        expires = "never"
        if token["expires"] is not None:
            expires = datetime.fromisoformat(token["expires"]).isoformat(timespec="seconds")
        if token["expired"]:
            expires += " (expired)"
        view.add_row(token["name"], token["role"], token["created"], expires)
    console.print(view)


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="The token's name (see token list).")],
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Revoke a service token: it is refused from its next request on."""
    _auth_store(data_dir).revoke_token(name)
    console.print(f"revoked service token {name}")


@app.command()
def audit(
    since: Annotated[
        str | None, typer.Option(help="Entries from this age (30s, 10m, 2h, 1d) or ISO time on.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, as stored.")] = False,
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """The audit log of the network service: who did what, with which outcome."""
    from shardflow.service.auth import AuditLog, parse_since

    start = parse_since(since) if since is not None else None
    entries = AuditLog(data_dir).entries(since=start)
    if as_json:
        for entry in entries:
            print(json.dumps(entry, ensure_ascii=False))
        return
    if not entries:
        console.print("no audit entries" + (f" since {start.isoformat()}" if start else ""))
        return
    view = Table("time", "who", "action", "arguments", "outcome", "ms")
    for entry in entries:
        cells = (
            str(entry.get("time")),
            str(entry.get("who")),
            str(entry.get("action")),
            json.dumps(entry.get("arguments"), ensure_ascii=False),
            str(entry.get("outcome")),
            f"{float(entry.get('duration_s') or 0) * 1000:.1f}",
        )
        view.add_row(*(Text(cell) for cell in cells))  # Text: "[...]" in SQL is not markup
    console.print(view)


@app.command()
def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option(help="Watch this namespace (repeatable); none: the whole cluster."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Log at debug level.")] = False,
) -> None:
    """Run the Kubernetes operator (ShardflowCluster, ShardMigration) until stopped; it needs
    the k8s extra: pip install 'shardflow[k8s]'. See docs/kubernetes.md."""
    try:
        from shardflow.k8s import operator as k8s_operator
    except ImportError as error:
        raise ConfigError(
            f"the operator needs the k8s extra (pip install 'shardflow[k8s]'): {error}"
        ) from None
    k8s_operator.run(namespace or [], verbose)


def main() -> None:
    try:
        app()
    except Error as error:
        console.print(f"[red]error:[/red] {type(error).__name__}: {error}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
