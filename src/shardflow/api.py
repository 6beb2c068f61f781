"""The public surface: ``connect()`` returns a :class:`Database`; ``db.cluster`` reports
what runs where."""

from __future__ import annotations

import functools
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import pyarrow as pa

from shardflow.catalog import DataDir
from shardflow.catalog.grants import Grant, granted, privileges_of, revoked
from shardflow.config import Settings
from shardflow.errors import (
    ClosedError,
    ConfigError,
    DrainTimeoutError,
    MigrationError,
    MoveCancelled,
    QueryError,
)
from shardflow.flightsql.client import RemoteDatabase
from shardflow.records import AnswerPart, BackupInfo, MigrationRecord, NodeInfo
from shardflow.runtime.client.session import Backend, Session
from shardflow.runtime.protocol import NodeLoad, ReplicaInfo, ShardInfo, WorkerInfo
from shardflow.runtime.query.executor import ExecutionReport
from shardflow.runtime.query.profiling import build_profile
from shardflow.sql.parameters import bind
from shardflow.sql.statements import (
    Change,
    ChangeRows,
    CreateTableAs,
    DropTable,
    Truncate,
    statement_of,
)
from shardflow.telemetry.profile import QueryProfile

MAX_LOCAL_WORKERS = 64
CLOSED = "the database is closed; call shardflow.connect() again"
CLOSE_WAIT_S = 10.0
"""How long ``close()`` waits for the calls in flight to end before it stops its cluster."""
GRANTS_SCHEMA = pa.schema(
    [
        ("table", pa.string()),
        ("grantee", pa.string()),
        ("privilege", pa.string()),
        ("grantee_id", pa.string()),
    ]
)
"""The columns of :meth:`Database.grants` (and of ``SHOW GRANTS`` over the service)."""
_GRANT_COLUMNS = GRANTS_SCHEMA.names

P = ParamSpec("P")
R = TypeVar("R")


class Runtime(Backend, Protocol):
    """What a database runs on: a cluster on Ray (``runtime/client/backend.RayBackend``) or
    one in this process (``runtime/inprocess.LocalBackend``)."""

    @property
    def data_dir(self) -> str: ...
    def leave_running(self) -> None: ...
    def close(self) -> None: ...


def _while_open(
    method: Callable[Concatenate[Any, P], R],
) -> Callable[Concatenate[Any, P], R]:
    """A public call of a :class:`Database` (or of its ``cluster``): refused with
    :class:`ClosedError` once the database is closed, and whatever it fails with while
    ``close()`` tears the cluster down under it also ends as a ``ClosedError`` (the cause
    chained), not as the Ray or DuckDB error the teardown caused."""

    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        db: Database = self if isinstance(self, Database) else self._db
        if db._closing.is_set():
            raise ClosedError(CLOSED)
        with db._in_flight:
            db._calls += 1
        try:
            return method(self, *args, **kwargs)
        except ClosedError:
            raise
        except BaseException as error:
            if db._closing.is_set():
                raise ClosedError(f"{CLOSED} (it was closed during this call)") from error
            raise
        finally:
            with db._in_flight:
                db._calls -= 1
                db._in_flight.notify_all()

    functools.update_wrapper(call, method)
    return call


def _node_info(node_id: str, info: WorkerInfo | None, load: NodeLoad | None) -> NodeInfo:
    """A node as ``db.cluster.nodes()`` shows it; a node whose worker does not answer is
    listed as not alive, with nothing known about it."""
    if info is None:
        return NodeInfo(
            node_id=node_id,
            alive=False,
            vendor="unknown",
            model="unknown",
            engine="unknown",
            memory_bytes=0,
            cores=0,
            capacity=load.capacity if load is not None else 0.0,
            simulated=False,
            shards=0,
            rows=0,
            bytes=0,
            queries_running=0,
            utilization=load.utilization if load is not None else None,
            busy_fraction=0.0,
            memory_used_bytes=0,
            memory_free_bytes=0,
            device_utilization=None,
            device_memory_used_bytes=None,
            device_memory_free_bytes=None,
            engine_note="",
            calibration={},
            health=load.health if load is not None else "healthy",
            failure_rate=load.failure_rate if load is not None else 0.0,
        )
    profile = info.profile
    cache = info.device_cache
    held: list[ShardInfo | ReplicaInfo] = [*info.shards, *info.replicas]
    return NodeInfo(
        node_id=node_id,
        alive=True,
        vendor=profile.vendor,
        model=profile.model,
        engine=profile.engine,
        memory_bytes=profile.memory_bytes,
        cores=profile.cores,
        capacity=load.capacity if load is not None else profile.capacity,
        simulated=profile.simulated,
        shards=len(info.shards),
        rows=sum(s.rows for s in held),
        bytes=sum(s.bytes for s in held),
        queries_running=info.queries_running,
        utilization=load.utilization if load is not None else None,
        busy_fraction=info.busy_seconds / max(info.uptime_seconds, 1e-9),
        memory_used_bytes=info.memory.used_bytes,
        memory_free_bytes=info.memory.free_bytes,
        device_utilization=info.device.utilization,
        device_memory_used_bytes=info.device.memory_used_bytes,
        device_memory_free_bytes=info.device.memory_free_bytes,
        engine_note="; ".join(n for n in (profile.engine_note, info.last_fallback) if n),
        calibration=dict(profile.calibration),
        ray_node_id=info.host.ray_node_id,
        host=info.host.address,
        ray_node_name=info.host.name,
        health=load.health if load is not None else "healthy",
        failure_rate=load.failure_rate if load is not None else 0.0,
        engine_memory_bytes=info.memory.engine_bytes,
        spilled_bytes=info.memory.spilled_bytes,
        memory_limit_bytes=info.memory.limit_bytes,
        pid=info.pid,
        device_cache_bytes=cache.bytes if cache is not None else 0,
        device_cache_budget_bytes=cache.budget_bytes if cache is not None else 0,
        device_cache_hit_rate=cache.hit_rate if cache is not None else None,
        release=info.release,
    )


def _finished(result: dict[str, Any]) -> MigrationRecord:
    record = MigrationRecord.from_dict(result)
    if record.phase != "done":
        raise MigrationError(
            f"{record.kind} of {', '.join(record.shards)} {record.outcome}", record
        )
    return record


class Cluster:
    """What is where (nodes and shards, reported live by the workers), and the operations
    that change it while queries and inserts keep running."""

    def __init__(self, database: Database) -> None:
        self._db = database

    # -- live operations ------------------------------------------------------------------
    @_while_open
    def migrate(self, shard: str | int, to: str) -> MigrationRecord:
        """Move a shard — with every shard co-located with it — to node ``to``, live.
        Raises :class:`MigrationError` if the move had to be rolled back."""
        session = self._db._session_or_raise()
        return _finished(session.migrate(session.unit_of(shard), to))

    @_while_open
    def split(self, shard: str | int) -> MigrationRecord:
        """Halve a shard's bucket range (and its co-located shards'), live."""
        session = self._db._session_or_raise()
        return _finished(session.split(session.unit_of(shard)))

    @_while_open
    def merge(self, first: str | int, second: str | int) -> MigrationRecord:
        """Join two adjacent shards (and their co-located shards) into one, live."""
        session = self._db._session_or_raise()
        return _finished(session.merge(session.unit_of(first), session.unit_of(second)))

    @_while_open
    def migrations(self) -> list[MigrationRecord]:
        """Every move so far, oldest first, with the time spent in each phase."""
        session = self._db._session_or_raise()
        return [MigrationRecord.from_dict(r) for r in session.migrations()]

    @_while_open
    def add_node(self, *, simulate_slowdown: float = 1.0) -> str:
        """Start a new worker; it joins the cluster and the balancer moves load to it.
        ``simulate_slowdown`` above 1 makes it a simulated slower device (tests, demos),
        labelled as simulated in its profile."""
        if not isinstance(simulate_slowdown, int | float) or simulate_slowdown < 1:
            raise ConfigError("simulate_slowdown must be a number >= 1")
        return self._db._session_or_raise().add_node(simulate_slowdown)

    @_while_open
    def drain(self, node: str, deadline: float = 300.0) -> list[MigrationRecord]:
        """Move every shard off ``node`` live, then stop it. If that cannot be done within
        ``deadline`` seconds, :class:`DrainTimeoutError` says so and the node keeps
        serving what it still holds; a drain stopped by :meth:`cancel_drain` raises
        :class:`MoveCancelled` (the node stays too)."""
        result = self._db._session_or_raise().drain(node, deadline)
        moved = [MigrationRecord.from_dict(r) for r in result.moved]
        if result.cancelled:
            raise MoveCancelled(result.reason)
        if not result.drained:
            raise DrainTimeoutError(result.reason, list(moved))
        return moved

    @_while_open
    def cancel_drain(self, node: str) -> bool:
        """Stop a running drain of ``node`` (from another thread or client): it starts no
        more moves, the one it runs rolls back where it has not switched yet, and the node
        stays, serving the shards it still holds (those moved off stay moved). Returns
        whether a drain of it was running."""
        return bool(self._db._session_or_raise().cancel_drain(node))

    @_while_open
    def coordinator_host(self) -> str:
        """The Ray node id of the node the coordinator runs on now (it restarts on another
        node when its node is lost)."""
        return self._db._session_or_raise().coordinator_host()

    @_while_open
    def drain_host(self, ray_node_id: str, deadline: float = 300.0) -> list[MigrationRecord]:
        """Ahead of taking a Ray node (a machine) away: drain every worker on it as
        :meth:`drain` does, stop them, and start no worker there again (``auto_join``).
        ``ray_node_id`` is a node's ``ray_node_id`` as :meth:`nodes` shows it. Raises
        :class:`DrainTimeoutError` if a worker still serves shards after ``deadline``."""
        reports = self._db._session_or_raise().drain_host(ray_node_id, deadline)
        moved = [MigrationRecord.from_dict(r) for report in reports for r in report.moved]
        for report in reports:
            if not report.drained:
                raise DrainTimeoutError(report.reason, moved)
        return moved

    @_while_open
    def rebalance(self, dry_run: bool = True) -> dict[str, Any]:
        """What the balancer would do now (``dry_run``), or do it. The plan lists splits,
        merges and moves with their reasons, what was balanced (load, or bytes while the
        cluster is idle), the current spread of load/capacity and the projected one."""
        return dict(self._db._session_or_raise().rebalance(dry_run))

    @_while_open
    def cancel(self, move_id: str) -> MigrationRecord:
        """Roll a running move, split, merge or drain step back, whatever its phase before
        the switch: its copy stops at its next chunk, the source serves throughout, nothing
        is lost; the move ends ``cancelled`` (``db.cluster.migrations()``, and counted as
        such in /metrics). Raises :class:`MoveRefusedError` for a move not running, or one
        past its switch (it ends as it would). Returns the move as it stood."""
        return MigrationRecord.from_dict(self._db._session_or_raise().cancel(move_id))

    @_while_open
    def pause_balancer(self) -> bool:
        """Start no balancing move until :meth:`resume_balancer` (moves running go on; a
        suspect node is still evacuated, which protects the data). Returns whether it was
        paused already."""
        return bool(self._db._session_or_raise().pause_balancer(True))

    @_while_open
    def resume_balancer(self) -> bool:
        """Let the balancer start moves again; returns whether it was paused."""
        return bool(self._db._session_or_raise().pause_balancer(False))

    @_while_open
    def record_access(self, denied_action: str | None) -> None:
        """Count a call refused at the door of a service built on this database
        (``shardflow serve``) in the coordinator's metrics: for the role's lack of
        ``denied_action``, or (None) for a wrong password or token. Not waited for."""
        self._db._session_or_raise().record_access(denied_action)

    @_while_open
    def backup(
        self,
        to: str,
        *,
        priority: str = "idle",
        max_rate_mb_s: float = 0.0,
        keep_log: bool = False,
    ) -> BackupInfo:
        """Back every table up into the folder or filesystem URI ``to``, as of one point in
        time, while queries, inserts and moves run on (``shardflow backup``; restored with
        ``shardflow restore``). Chunks a backup in ``to`` holds already are not written
        again: the next backup there is incremental. ``priority`` (``idle``, ``low``,
        ``normal``): the copy's CPU priority; ``max_rate_mb_s``: a cap (0: none);
        ``keep_log``: keep the log from now on, so that ``shardflow restore --as-of`` can
        restore any time between this backup and the next (``--keep-log``)."""
        if not isinstance(to, str | os.PathLike) or not os.fspath(to):
            raise ConfigError(f"backup: to must be a folder or URI, not {to!r}")
        from shardflow.storage import backup

        data_dir = DataDir.resolve(self._db._backend.data_dir)
        return backup.backup(
            data_dir,
            os.fspath(to),
            priority=priority,
            max_rate_mb_s=max_rate_mb_s,
            keep_log=keep_log,
        )

    @_while_open
    def metrics_url(self) -> str:
        """Where the coordinator serves Prometheus metrics (always on 127.0.0.1). The same
        address without ``/metrics`` is the read-only console page."""
        return self._db._session_or_raise().metrics_url()

    @_while_open
    def failovers(self) -> list[dict[str, Any]]:
        """Workers declared dead, with how long until their shards were served again."""
        return list(self._db._session_or_raise().failovers())

    @_while_open
    def nodes(self) -> list[NodeInfo]:
        session = self._db._session_or_raise()
        infos = session.worker_infos()
        loads = session.node_loads()
        return [_node_info(node_id, info, loads.get(node_id)) for node_id, info in infos.items()]

    @_while_open
    def shards(self) -> pa.Table:
        """One row per shard (and per replica of a replicated table). ``load`` is the
        shard's execution seconds per second on its node over the balancer's last observed
        window (``balance_interval_s``); the balancer weighs them by the node's speed
        (``control/cost.py``). Null until a window has passed, and for replicas.
        ``indexed``: the shard keeps its index on the table's key (``key_index``)."""
        session = self._db._session_or_raise()
        infos = session.worker_infos()
        loads = session.shard_loads()
        catalog = session.whole()
        rows: dict[str, list[Any]] = defaultdict(list)
        for node_id, info in sorted(infos.items()):
            if info is None:  # gone: it holds nothing any more
                continue
            for shard in info.shards:
                spec = catalog.tables.get(shard.table)
                unit = None
                if spec is not None and spec.group is not None:
                    unit = catalog.groups[spec.group].unit(shard.unit)
                rows["table"].append(shard.table)
                rows["shard"].append(f"{shard.table}#{shard.unit}")
                rows["node"].append(node_id)
                rows["kind"].append("distributed")
                rows["bucket_lo"].append(unit.lo if unit else None)
                rows["bucket_hi"].append(unit.hi if unit else None)
                rows["rows"].append(shard.rows)
                rows["bytes"].append(shard.bytes)
                rows["lsn"].append(shard.lsn)
                rows["load"].append(loads.get((shard.table, shard.unit)))
                rows["indexed"].append(shard.indexed)
            for replica in info.replicas:
                rows["table"].append(replica.table)
                rows["shard"].append(f"{replica.table}@{node_id}")
                rows["node"].append(node_id)
                rows["kind"].append("replica")
                rows["bucket_lo"].append(None)
                rows["bucket_hi"].append(None)
                rows["rows"].append(replica.rows)
                rows["bytes"].append(replica.bytes)
                rows["lsn"].append(replica.lsn)
                rows["load"].append(None)
                rows["indexed"].append(False)
        schema = pa.schema(
            [
                ("table", pa.string()),
                ("shard", pa.string()),
                ("node", pa.string()),
                ("kind", pa.string()),
                ("bucket_lo", pa.int32()),
                ("bucket_hi", pa.int32()),
                ("rows", pa.int64()),
                ("bytes", pa.int64()),
                ("lsn", pa.int64()),
                ("load", pa.float64()),
                ("indexed", pa.bool_()),
            ]
        )
        return pa.table({f.name: rows[f.name] for f in schema}, schema=schema)


class Database:
    """A connection to a shardflow cluster. Use as a context manager, or call ``close()``."""

    def __init__(self, backend: Runtime, session: Session) -> None:
        self._backend = backend
        self._session: Session | None = session
        self._closing = threading.Event()
        self._in_flight = threading.Condition()
        self._calls = 0
        """Public calls under way (``close()`` lets them end before it stops Ray)."""
        self.cluster = Cluster(self)
        self.last_report: ExecutionReport | None = None
        """How the last ``sql()`` ran: planning time, per-stage fragments and merges."""

    def _session_or_raise(self) -> Session:
        session = self._session
        if session is None:
            raise ClosedError(CLOSED)
        return session

    @property
    def settings(self) -> Settings:
        """The settings this database's cluster runs with."""
        return self._backend.settings

    @_while_open
    def keep_running(self) -> None:
        """Leave the cluster running when this database closes: a service started on a Ray
        cluster (``connect(address=...)``) by a command that ends, as ``shardflow serve``
        does. ``ConfigError`` for an embedded cluster, which stops with its process."""
        self._backend.leave_running()

    # -- queries ------------------------------------------------------------------------
    @_while_open
    def sql(self, query: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run a query over the cluster and return its answer; or a statement that changes
        tables, as the Flight SQL service runs it: ``INSERT INTO t [(columns)] SELECT ... |
        VALUES ...`` (answers ``count``, the rows appended), ``TRUNCATE [TABLE] t``
        (answers ``count``, the rows it held; every query sees the table whole or empty),
        ``DELETE FROM t [WHERE ...]`` and ``UPDATE t SET c = e, ... [WHERE ...]`` (answer
        ``count``, the rows changed; all or nothing across shards, and every query sees
        the change on every shard or on none),
        ``CREATE TABLE t AS SELECT ...`` and ``DROP TABLE [IF EXISTS] t`` (answer
        nothing). ``params`` fill the
        statement's ``?`` placeholders in order (or ``$1``, ``$2`` ... by number) as values,
        never as SQL: ``db.sql("SELECT * FROM t WHERE id = ?", [42])``."""
        if params is not None:
            query = bind(query, params)
        change = statement_of(query)
        if change is not None:
            return self._change(change)
        result, report = self._session_or_raise().query(query)
        self.last_report = report
        return result

    @_while_open
    def stream(self, query: str, params: Sequence[Any] | None = None) -> pa.RecordBatchReader:
        """Run a query and read its answer as it arrives: a ``RecordBatchReader`` whose
        batches come as the workers have them, with at most ``stream_buffer_mb`` of them
        waiting here at once whatever the answer's size (an ORDER BY, with a LIMIT or not,
        comes as the workers' sorted parts are interleaved here; an answer finished in one
        place first, by an aggregate's merge, is held whole). Close the reader to stop
        early. Where the cluster changes under an answer read in part (a worker dies while
        it sends, units are split), reading raises ``ClusterError``: run it again."""
        if params is not None:
            query = bind(query, params)
        if statement_of(query) is not None:
            raise QueryError("db.stream() reads queries; run statements with db.sql()")
        answer = self._session_or_raise().stream(query)

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                yield from answer
            except ClosedError:
                raise
            except Exception as error:  # the lanes broke as close() stopped the workers:
                if self._closing.is_set():  # say why, not "run it again"
                    raise ClosedError(CLOSED) from error
                raise

        return pa.RecordBatchReader.from_batches(answer.schema, batches())

    @_while_open
    def endpoints(
        self,
        query: str,
        params: Sequence[Any] | None = None,
        *,
        user: str = "",
        credential: str = "",
        tls: bool = False,
    ) -> tuple[pa.Schema, list[AnswerPart]] | None:
        """Reserve ``query``'s answer in parts on the workers that hold them, to be read
        straight from each (the Flight SQL service's ``flight_endpoints = "workers"``):
        the answer's schema and a part per worker, whose ``ticket`` a Flight ``DoGet`` at
        its ``location`` reads once, within ``endpoint_ticket_ttl_s``, sending
        ``credential`` as its bearer token (any caller where it is ""). The parts' shards
        stay readable on their workers until then, whatever moves. None where the answer
        is not its parts put one after the other (a merge, ORDER BY, LIMIT, one unit) or a
        worker has no endpoint (with ``tls``: none that speaks TLS, ``endpoint_tls_cert``):
        read it with :meth:`stream`. ``user`` names the caller in the audit log of refused
        tickets."""
        if params is not None:
            query = bind(query, params)
        if statement_of(query) is not None:
            raise QueryError("db.endpoints() reads queries; run statements with db.sql()")
        return self._session_or_raise().endpoints(query, user, credential, tls)

    def _change(self, change: Change) -> pa.Table:
        if isinstance(change, DropTable):
            if not (change.if_exists and self._session_or_raise().access(change.name) is None):
                self.drop_table(change.name)
            return pa.table({})
        if isinstance(change, Truncate):
            count = self._session_or_raise().truncate_table(change.name)
            return pa.table({"count": pa.array([count], pa.int64())})
        if isinstance(change, ChangeRows):
            count, returned = self._session_or_raise().change_rows(change)
            if returned is not None:
                return returned
            return pa.table({"count": pa.array([count], pa.int64())})
        rows = self.sql(change.query)
        if isinstance(change, CreateTableAs):
            self.create_table(change.name, rows)
            return pa.table({})
        columns = list(change.columns or self.schema(change.name).names)
        count = self.insert(change.name, rows.rename_columns(columns[: rows.num_columns]))
        return pa.table({"count": pa.array([count], pa.int64())})

    @_while_open
    def explain(self, query: str) -> str:
        """Where each part of ``query`` would run, and why."""
        return self._session_or_raise().explain(query)

    @_while_open
    def profile(self, query: str) -> tuple[pa.Table, QueryProfile]:
        """Run ``query`` and say where its time went: planning, and per fragment the
        worker, device, engine, queue wait, execution, rows and bytes in and out, transfer;
        and the merges. ``profile.text()`` is a tree, ``profile.html()`` a timeline page
        with one lane per worker."""
        session = self._session_or_raise()
        collecting, session.profiling = session.profiling, True
        try:
            result, report = session.query(query)
        finally:
            session.profiling = collecting
        self.last_report = report
        return result, build_profile(query, report)

    # -- tables -------------------------------------------------------------------------
    @_while_open
    def create_table(
        self,
        name: str,
        source: object,
        *,
        distributed_by: str | None = None,
        replicated: bool = False,
        colocate_with: str | None = None,
        key_index: bool = False,
        progress: bool = False,
        grants: Sequence[tuple[str, str, str]] | None = None,
    ) -> int:
        """Create and load a table from a Parquet file/directory (path or URI), a
        ``pyarrow.Table`` or an Arrow stream (a ``pyarrow.RecordBatchReader``, or anything with
        ``__arrow_c_stream__``: a DuckDB relation, a Polars DataFrame); returns the rows
        loaded. A stream is read once, batch by batch, as it is loaded.

        ``distributed_by`` hashes that column into buckets (shards own bucket ranges);
        ``colocate_with`` keeps the shards of equal bucket ranges of both tables on one worker
        so joins on the key run locally; ``replicated=True`` puts a copy on every worker;
        neither spreads rows evenly. ``key_index=True`` keeps an index on the
        ``distributed_by`` column in every shard: a lookup of one key (``WHERE key = ?``;
        DuckDB scans for IN lists) fetches its rows instead of scanning the shard, at ~33
        bytes of memory a row and ~35 % more time per insert; worth it for tables that
        serve point lookups, above all those with long text columns (a scan that returns
        one row decodes their compressed text whole). Nothing is visible, and nothing stays
        behind on failure, until the load is complete and durable.

        ``grants`` are who may reach it through the Flight SQL service (see :meth:`grants`;
        the service gives OWNER to the account making it, and nothing else). Without them
        the table is shared: PUBLIC holds every privilege.
        """
        session = self._session_or_raise()
        if not progress:
            return session.create_table(
                name,
                source,
                distributed_by,
                replicated,
                colocate_with,
                key_index=key_index,
                grants=grants,
            )
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress(
            f"loading {name}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        ) as bar:
            task = bar.add_task(name, total=None)

            def report(done: int, total: int | None) -> None:
                bar.update(task, completed=done, total=total)

            return session.create_table(
                name, source, distributed_by, replicated, colocate_with, report, key_index, grants
            )

    @_while_open
    def insert(
        self, name: str, data: pa.Table | pa.RecordBatch, *, batch_id: str | None = None
    ) -> int:
        """Append rows; durable on every owner before it returns. Returns the row count.

        ``batch_id`` makes a retry safe: rows sent again under the same id are kept once."""
        return self._session_or_raise().insert(name, data, batch_id)

    @_while_open
    def drop_table(self, name: str) -> None:
        self._session_or_raise().drop_table(name)

    @_while_open
    def grants(self, table: str | None = None) -> pa.Table:
        """Who may do what with each table (or only ``table``, read from the coordinator
        now) through the Flight SQL service: a row per grant with the table, the
        ``grantee`` (an account, a role: every account of it or a higher one, or PUBLIC:
        every account), the ``privilege`` (SELECT, INSERT, UPDATE, DELETE, or OWNER: all
        of them, granting them and dropping the table) and ``grantee_id`` (the account's id:
        one removed and made again under the name is another and does not inherit). A
        table without grants has one row, grantee and privilege null: only operators reach
        it. This API is the cluster owner's door: nothing here checks grants; the service
        does, on every call."""
        session = self._session_or_raise()
        if table is None:
            specs = sorted(session.whole().tables.values(), key=lambda s: s.name)
        else:
            spec = session.access(table)
            if spec is None:
                session.table_spec(table)  # the unknown table's error, naming the tables
            specs = [spec] if spec is not None else []
        rows: dict[str, list[Any]] = defaultdict(list)
        for spec in specs:
            for grant in spec.grants or [(None, None, None)]:
                values = (spec.name, *grant)
                for column, value in zip(_GRANT_COLUMNS, values, strict=True):
                    rows[column].append(value)
        return pa.table({c: rows[c] for c in _GRANT_COLUMNS}, schema=GRANTS_SCHEMA)

    @_while_open
    def grant(
        self, table: str, privileges: str | Sequence[str], to: str, *, grantee_id: str = ""
    ) -> None:
        """Give ``to`` (an account, a role or PUBLIC) ``privileges`` (SELECT, INSERT,
        UPDATE, DELETE, ALL) on ``table``, as ``GRANT`` over the service does.
        ``grantee_id``: the account's id (the service gives it), so that the grant ends with
        that account."""
        self._change_grants(
            table, privileges, lambda old, wanted: granted(old, to, wanted, grantee_id)
        )

    @_while_open
    def revoke(self, table: str, privileges: str | Sequence[str], from_: str) -> None:
        """Take ``privileges`` on ``table`` from ``from_``, as ``REVOKE`` over the service
        does (a grant to a role or PUBLIC is taken from the role, not from each account)."""
        self._change_grants(table, privileges, lambda old, wanted: revoked(old, from_, wanted))

    def _change_grants(
        self,
        table: str,
        privileges: str | Sequence[str],
        change: Callable[[tuple[Grant, ...], tuple[str, ...]], tuple[Grant, ...]],
    ) -> None:
        session = self._session_or_raise()
        try:
            wanted = privileges_of([privileges] if isinstance(privileges, str) else privileges)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        spec = session.access(table)
        if spec is None:
            session.table_spec(table)  # the unknown table's error, naming the tables
            return
        session.set_grants(spec.name, change(spec.grants, wanted))

    @_while_open
    def table_names(self) -> list[str]:
        """The tables' names, as the coordinator knows them now (no worker is asked)."""
        return sorted(self._session_or_raise().whole().tables)

    @_while_open
    def schema(self, name: str) -> pa.Schema:
        """A table's columns and their types (``UnknownTableError`` where there is none)."""
        return self._session_or_raise().table_spec(name).schema

    @_while_open
    def tables(self) -> pa.Table:
        """One row per table: how it is distributed, its shards (a replicated table's
        copies, one a node, as ``cluster.shards()`` lists them) and its rows now."""
        session = self._session_or_raise()
        infos = session.worker_infos()
        rows: dict[str, int] = defaultdict(int)
        shards: dict[str, int] = defaultdict(int)
        for info in infos.values():
            for shard in info.shards if info is not None else ():
                rows[shard.table] += shard.rows
                shards[shard.table] += 1
            for replica in info.replicas if info is not None else ():
                shards[replica.table] += 1  # a replicated table's copies, one a node
        catalog = session.whole()
        primary_info = infos.get(catalog.primary) if catalog.primary is not None else None
        for replica in primary_info.replicas if primary_info is not None else ():
            rows[replica.table] = replica.rows
        specs = sorted(catalog.tables.values(), key=lambda s: s.name)
        return pa.table(
            {
                "name": [s.name for s in specs],
                "kind": [s.kind for s in specs],
                "distributed_by": [s.key or None for s in specs],
                "colocation_group": [s.group for s in specs],
                "key_index": [s.key_index for s in specs],
                "shards": [shards[s.name] for s in specs],
                "rows": [rows[s.name] for s in specs],
                "columns": [s.schema.names for s in specs],
            }
        )

    # -- life cycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop what ``connect`` started. Safe to call twice."""
        if self._session is None:
            return
        self._closing.set()  # calls in flight end with ClosedError (see _while_open)
        session, self._session = self._session, None
        session.close()
        # A thread that touches Ray after it stopped ends the whole process (Ray's core
        # worker exits): the calls in flight see the closed session and end first (a load
        # between its batches, a query between its retries), waited for a while at most
        with self._in_flight:
            self._in_flight.wait_for(lambda: self._calls == 0, CLOSE_WAIT_S)
        self._backend.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def connect(
    address: str | None = None,
    *,
    workers: int | None = None,
    data_dir: str | os.PathLike[str] = "./.shardflow",
    settings: Settings | None = None,
    simulate: dict[str, float] | None = None,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    tls_root_certs: bytes | None = None,
    in_process: bool = False,
    **options: Any,
) -> Database | RemoteDatabase:
    """Start or join a shardflow cluster, or connect to a served one.

    With a Flight address (``"grpc://127.0.0.1:8815"``, ``"grpc+tls://host:port"``) this
    connects to ``shardflow serve`` over Arrow Flight SQL as ``user``/``password`` or with
    a service ``token`` and returns a :class:`~shardflow.flightsql.client.RemoteDatabase`: the same
    methods, each checked against the caller's role on the server
    (``tls_root_certs``: the PEM certificates to trust for TLS).

    With no ``address``, an embedded Ray cluster bound to 127.0.0.1 starts in this process:
    unless ``workers`` says how many worker actors to start, one per GPU where there are GPUs
    (pinned to the GPU and its accelerator type), else 4. With an ``address``
    (``"host:port"``, ``"auto"``), shardflow joins that Ray cluster: if a service serves
    ``data_dir`` there already (``shardflow serve``, another session) this attaches to it;
    else it starts one, with a worker pinned to every Ray node (one per GPU on GPU nodes;
    ``workers`` spreads that many over the nodes instead), as detached actors that
    ``close()`` stops again. A loopback address keeps this process's Ray on 127.0.0.1.
    ``data_dir`` (a local
    path or any pyarrow filesystem URI) holds the catalog and every table's durable files;
    reconnecting to it recovers them.
    ``options`` override single fields of :class:`Settings`. ``simulate`` makes some nodes
    simulated slower devices for tests and demos (``{"node-2": 2.0}``: twice as slow).
    ``in_process=True`` runs the same coordinator and workers in this process, without Ray
    (no Ray start: a one-shot script or command on a data directory answers in a second or
    two; the workers share this process and its cores): the cluster ``data_dir`` last had,
    its nodes under their ids, or ``workers`` nodes (4 by default) for a new one.
    """
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ConfigError(f"address must be None, 'auto' or a Ray address, not {address!r}")
    if address is not None and address.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
        return RemoteDatabase(
            address, user=user, password=password, token=token, tls_root_certs=tls_root_certs
        )
    if user is not None or password is not None or token is not None:
        raise ConfigError("user=, password= and token= are for a served cluster (grpc://...)")
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise ConfigError(f"workers must be a whole number, not {workers!r}")
        if not 1 <= workers <= MAX_LOCAL_WORKERS:
            raise ConfigError(f"workers must be between 1 and {MAX_LOCAL_WORKERS}, got {workers}")
    if not isinstance(data_dir, str | os.PathLike) or not os.fspath(data_dir):
        raise ConfigError(f"data_dir must be a path or URI, not {data_dir!r}")
    if settings is not None and not isinstance(settings, Settings):
        raise ConfigError(f"settings must be a shardflow.Settings, not {type(settings).__name__}")
    settings = (settings or Settings()).replace(**options) if options else (settings or Settings())
    path = os.fspath(data_dir)
    if "://" not in path:
        path = os.path.abspath(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"data_dir {path!r} exists and is not a directory")
    try:  # before anything starts: a data directory that cannot be written is refused
        DataDir.resolve(path).probe()
    except (OSError, pa.ArrowException) as error:
        raise ConfigError(f"data_dir {path!r} cannot be written: {error}") from None
    if simulate is not None and (
        not isinstance(simulate, dict)
        or not all(isinstance(v, int | float) and v >= 1 for v in simulate.values())
    ):
        raise ConfigError("simulate maps node ids to slowdown factors >= 1, e.g. {'node-2': 2}")
    backend: Runtime
    if in_process:
        if address is not None or simulate is not None:
            raise ConfigError("in_process=True runs without Ray: no address=, no simulate=")
        from shardflow.runtime.inprocess import launch_in_process

        backend = launch_in_process(path, workers, settings)
    else:
        from shardflow.runtime.client.backend import launch_on_ray

        backend = launch_on_ray(address, workers, path, settings, simulate)
    try:
        session = Session(backend)
    except BaseException:
        backend.close()
        raise
    return Database(backend, session)
