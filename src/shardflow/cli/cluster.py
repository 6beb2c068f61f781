"""``shardflow cluster``: the cluster of a data directory (its nodes, shards and moves) and
a real multi-node Ray cluster on this machine (``cluster up``: each node its own processes,
all on 127.0.0.1)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import pyarrow as pa
import typer
from rich.table import Table

from shardflow.cli.common import (
    Address,
    DataDir,
    Format,
    FormatOption,
    ServiceDir,
    Sets,
    Token,
    User,
    Workers,
    app,
    attach,
    connect_to,
    console,
    local_cluster,
    print_table,
    start_service,
    status,
    write,
)
from shardflow.errors import ConfigError, Error, MoveRefusedError

if TYPE_CHECKING:
    from shardflow.api import Database
    from shardflow.tools.localcluster import LocalNode, LocalRayCluster

cluster_app = typer.Typer(
    help="The cluster of a data directory — its nodes, shards and moves (attached to the "
    "one serving it, else an embedded one) — and a real multi-node Ray cluster on this "
    "machine (cluster up: each node its own processes, all on 127.0.0.1).",
    no_args_is_help=True,
)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("nodes")
def cluster_nodes(
    data_dir: DataDir = Path(".shardflow"),
    address: Address = None,
    user: User = None,
    token: Token = None,
    form: FormatOption = Format.table,
) -> None:
    """Every node: device, engine, capacity, utilisation, health, shards, rows, bytes."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
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
    write(pa.Table.from_pylist(rows), form, fit=True)


@cluster_app.command("shards")
def cluster_shards(
    data_dir: DataDir = Path(".shardflow"),
    address: Address = None,
    user: User = None,
    token: Token = None,
    form: FormatOption = Format.table,
) -> None:
    """Every shard: its table, unit, bucket range, node, rows and bytes."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
        write(db.cluster.shards(), form, fit=True)


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
    address: Address = None,
    user: User = None,
    token: Token = None,
    form: FormatOption = Format.table,
) -> None:
    """The history of live moves: phase, outcome, time, bytes, the write fence, why."""
    with connect_to(data_dir, address, looks=True, user=user, token=token) as db:
        write(_moves_table(db.cluster.migrations()), form, fit=True)


@cluster_app.command("migrate")
def cluster_migrate(
    shard: Annotated[str, typer.Argument(help="A shard (lineitem#3), as cluster shards lists.")],
    to: Annotated[str, typer.Argument(help="The node it moves to (node-2).")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Move a shard (with every shard co-located with it) to another node, live."""
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        with console.status(f"moving {shard} to {to}"):
            record = db.cluster.migrate(shard, to)
    print_table(_moves_table([record]))


@cluster_app.command("drain")
def cluster_drain(
    node: Annotated[str, typer.Argument(help="A shardflow node (node-1).")],
    deadline: Annotated[float, typer.Option(help="Seconds the drain may take.")] = 300.0,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Move every shard off a node live, then stop its worker."""
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        with console.status(f"draining {node}"):
            moved = db.cluster.drain(node, deadline)
    console.print(f"drained {node}: {len(moved)} move(s)")
    if moved:
        print_table(_moves_table(moved))


@cluster_app.command("cancel")
def cluster_cancel(
    move_id: Annotated[str, typer.Argument(help="The move's id (`shardflow cluster migrations`).")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Roll a running move, split, merge or drain step back: its copy stops, the source
    serves throughout, nothing is lost."""
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        record = db.cluster.cancel(move_id)
    console.print(f"move {move_id} ({record.kind}, in {record.phase}) is rolled back")


@cluster_app.command("cancel-drain")
def cluster_cancel_drain(
    node: Annotated[str, typer.Argument(help="The node being drained.")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Stop a running drain: it starts no more moves, its running one rolls back, and the
    node stays, serving what it still holds."""
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        stopped = db.cluster.cancel_drain(node)
    if not stopped:
        raise ConfigError(f"no drain of {node} is running")
    console.print(f"the drain of {node} is cancelled; it stays and serves what it holds")


@cluster_app.command("balancer")
def cluster_balancer(
    action: Annotated[str, typer.Argument(help="pause or resume")],
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """Pause the balancer (it starts no move; moves running go on, a suspect node is still
    evacuated) or resume it, while the cluster runs."""
    if action not in ("pause", "resume"):
        raise ConfigError(f"`cluster balancer` takes pause or resume, not {action!r}")
    with connect_to(data_dir, address, workers, user=user, token=token) as db:
        was = db.cluster.pause_balancer() if action == "pause" else db.cluster.resume_balancer()
    if action == "pause":
        console.print("the balancer is paused" + (" (it was already)" if was else ""))
    else:
        console.print("the balancer runs" + ("" if was else " (it was not paused)"))


@cluster_app.command("rebalance")
def cluster_rebalance(
    apply: Annotated[
        bool, typer.Option("--apply", help="Carry the plan out (default: only show it).")
    ] = False,
    data_dir: DataDir = Path(".shardflow"),
    workers: Workers = None,
    address: Address = None,
    user: User = None,
    token: Token = None,
) -> None:
    """What the balancer would do now (splits, merges and moves, with their reasons), or
    do it with --apply."""
    with connect_to(data_dir, address, workers, looks=not apply, user=user, token=token) as db:
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
        print_table(pa.Table.from_pylist(rows))
    if apply:
        console.print(f"{len(plan.get('moves', []))} move(s) done")


@cluster_app.command("up")
def cluster_up(
    nodes: Annotated[int, typer.Option(min=1, max=16, help="Data nodes to start.")] = 3,
    data_dir: ServiceDir = Path(".shardflow"),
    object_store_mb: Annotated[int, typer.Option(min=64, help="Object store per node.")] = 256,
    assignments: Sets = None,
    ha: Annotated[
        bool,
        typer.Option(
            "--ha",
            help="Survive the loss of the head: its state is kept in Redis (one started here "
            "on loopback with a password of its own, unless --redis names one) and the head "
            "is started again when it dies.",
        ),
    ] = False,
    redis: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT of a Redis for the head's state (with --ha); its password is read "
            "from SHARDFLOW_REDIS_PASSWORD.",
        ),
    ] = None,
) -> None:
    """Start a head node and NODES data nodes, then shardflow on them (one worker each)."""
    from shardflow.tools.localcluster import Redis
    from shardflow.tools.raynode import PASSWORD_VARIABLE

    local = local_cluster(data_dir)
    store = None
    if redis is not None:
        if ":" not in redis:
            raise ConfigError(f"--redis wants HOST:PORT, not {redis!r}")
        store = Redis(redis, os.environ.get(PASSWORD_VARIABLE, ""))
    console.print(f"starting a head and {nodes} data node(s) on 127.0.0.1, one at a time")

    def started(node: LocalNode) -> None:
        what = "the head (no shards)" if node.head else "a data node"
        console.print(f"  Ray node {node.name} started: {what}, pid {node.pid}")

    local.up(nodes, object_store_mb, started, ha=ha or store is not None, redis=store)
    console.print(f"Ray cluster up at {local.address}: head + {nodes} data nodes")
    if local.ha is not None:
        console.print(f"the head keeps its state in Redis at {local.ha.redis}: it survives loss")
    console.print("starting shardflow on it: a worker on every data node")
    try:
        with status.status("starting shardflow"):
            start_service(local.address, data_dir, None, assignments)
    except BaseException:
        local.down()
        raise


@cluster_app.command("address")
def cluster_address(data_dir: ServiceDir = Path(".shardflow")) -> None:
    """Print the local cluster's Ray address (for connect(address=...))."""
    print(local_cluster(data_dir).address)


@cluster_app.command("status")
def cluster_status(data_dir: ServiceDir = Path(".shardflow")) -> None:
    """Ray nodes, shardflow nodes and their shards, and health."""
    local = local_cluster(data_dir)
    view = Table("Ray node", "pid", "process", "Ray node id")
    for node in local.nodes():
        name = node.name + (" (head)" if node.head else "")
        view.add_row(name, str(node.pid), "running" if node.alive else "gone", node.node_id[:12])
    console.print(view)
    if local.ha is not None:
        back = "running" if local.head_process() is not None else "starting again"
        console.print(f"head: survives its loss (state in Redis at {local.ha.redis}; {back})")
    with attach(local.address, data_dir) as db:
        nodes = db.cluster.nodes()
        view = Table("node", "Ray node", "host", "alive", "shards", "rows", "engine", "release")
        for info in nodes:
            view.add_row(
                info.node_id,
                info.ray_node_name or info.ray_node_id[:12],
                info.host,
                "yes" if info.alive else "NO",
                str(info.shards),
                str(info.rows),
                info.engine,
                info.release or "0.2.0 or before",
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
    local = local_cluster(data_dir)
    with attach(local.address, data_dir) as db:
        if _add_node(local, db, wait) is None:
            raise typer.Exit(1)


def _add_node(local: LocalRayCluster, db: Database, wait: float) -> LocalNode | None:
    """Start a data node (with this shardflow) and wait for a worker on it; None where
    none came within ``wait`` seconds."""
    node = local.add_node()
    console.print(f"Ray node {node.name} started ({node.node_id[:12]})")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        joined = [n.node_id for n in db.cluster.nodes() if n.ray_node_id == node.node_id]
        if joined:
            console.print(f"shardflow node {', '.join(joined)} runs on {node.name}")
            return node
        time.sleep(0.5)
    console.print(f"[red]no shardflow worker started on {node.name} within {wait:g}s")
    return None


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
    live before the deadline), or killed outright. The head of a cluster up with --ha can
    be killed (--kill): it is started again, and the cluster serves meanwhile."""
    local = local_cluster(data_dir)
    if node == "head" and kill:
        started = time.monotonic()
        local.wait_head(local.kill_head())
        back = time.monotonic() - started
        console.print(f"Ray node head killed; it runs again after {back:.1f}s")
        return
    with attach(local.address, data_dir) as db:
        by_shardflow = {n.node_id: n.ray_node_name for n in db.cluster.nodes()}
        name = by_shardflow.get(node) or node
        if not kill:
            _drain(local, db, name, deadline)
    local.remove_node(name, kill=kill)
    console.print(f"Ray node {name} {'killed' if kill else 'stopped'}")


def _drain(local: LocalRayCluster, db: Database, name: str, deadline: float) -> None:
    """Have Ray drain the data node ``name`` and wait until shardflow serves nothing there
    (its shards moved off live); exits with 1 after ``deadline`` seconds."""
    from shardflow.runtime.ray.bootstrap import request_ray_drain

    target = local.node(name)
    nodes = db.cluster.nodes()
    here = [n for n in nodes if n.alive and n.ray_node_id == target.node_id]
    elsewhere = [n for n in nodes if n.alive and n.ray_node_id != target.node_id]
    if here and not elsewhere:
        raise MoveRefusedError(
            f"{name} is the last data node: its shards have nowhere to go. Add one first "
            "(shardflow cluster add-node), or stop the whole cluster (shardflow cluster "
            "down); --kill takes it away as a crash would"
        )
    request_ray_drain(target.node_id, deadline)
    ends = time.monotonic() + deadline
    with console.status(f"draining {name}"):
        while any(n.ray_node_id == target.node_id for n in db.cluster.nodes()):
            if time.monotonic() > ends:
                console.print(f"[red]{name} still serves shards after {deadline:g}s")
                raise typer.Exit(1)
            time.sleep(0.5)
    console.print(f"drained {name}: no shard is served there any more")


@cluster_app.command("upgrade")
def cluster_upgrade(
    data_dir: ServiceDir = Path(".shardflow"),
    wait: Annotated[float, typer.Option(help="Seconds to wait for each new worker.")] = 60.0,
    deadline: Annotated[float, typer.Option(help="Seconds each drain may take.")] = 300.0,
) -> None:
    """Replace the data nodes whose workers run another release by nodes of this one, one at
    a time, while the cluster serves: a new node joins, then an old one is drained and
    stopped. The coordinator's node goes last; the coordinator starts again on a node of
    this release (releases one apart serve together: CHANGELOG)."""
    from shardflow.catalog.version import release

    ours = release()
    local = local_cluster(data_dir)
    with attach(local.address, data_dir) as db:
        runs = {n.ray_node_id: n.release for n in db.cluster.nodes() if n.alive}
        old = [n for n in local.nodes() if not n.head and runs.get(n.node_id, ours) != ours]
        coordinator = db.cluster.coordinator_host()
        old.sort(key=lambda n: n.node_id == coordinator)  # its node last
        console.print(
            f"{len(old)} data node(s) to replace with release {ours}: "
            + (", ".join(n.name for n in old) or "none")
        )
        for node in old:
            if _add_node(local, db, wait) is None:
                raise typer.Exit(1)
            _drain(local, db, node.name, deadline)
            local.remove_node(node.name)
            console.print(f"Ray node {node.name} stopped")
        if old:
            started = time.monotonic()
            host = _coordinator_host(db, wait)
            name = next((n.name for n in local.nodes() if n.node_id == host), host[:12])
            console.print(
                f"the coordinator answers on {name} "
                f"({time.monotonic() - started:.1f}s after the last old node stopped)"
            )
        serving = {n.ray_node_id for n in db.cluster.nodes() if n.alive}
        idle = [n.name for n in local.nodes() if not n.head and n.node_id not in serving]
    console.print(f"every worker runs release {ours}")
    if idle:  # no worker there to say its release: left as they are
        console.print(
            f"data node(s) with no worker, left as they are: {', '.join(idle)} (remove them "
            "with shardflow cluster remove-node, or add nodes of this release)"
        )


def _coordinator_host(db: Database, wait: float) -> str:
    """The coordinator's Ray node, asked until it answers (it starts again after its node
    was stopped) or ``wait`` seconds passed."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return db.cluster.coordinator_host()
        except Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@cluster_app.command("down")
def cluster_down(data_dir: ServiceDir = Path(".shardflow")) -> None:
    """Stop shardflow and every Ray node of the local cluster."""
    from shardflow.runtime.ray.bootstrap import stop_service

    local = local_cluster(data_dir)
    if local.running:
        try:
            stop_service(local.address, str(data_dir.absolute()))
        except Error as error:
            console.print(f"(shardflow was not running: {error})")
    local.down()
    console.print("local cluster stopped")
