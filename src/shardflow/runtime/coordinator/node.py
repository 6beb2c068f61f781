"""The coordinator's logic in one process, whatever carries its calls: the catalog's owner
(:class:`CoordinatorState`), its control loops (:class:`Controller`), its Prometheus endpoint
and the read-only console page beside it. ``runtime/ray/actors.py`` puts it on Ray;
``runtime/inprocess.py`` calls it in this process. Each operation of the
:class:`~shardflow.runtime.protocol.Coordinator` protocol is one method here."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from shardflow.catalog import OwnerToken, TableSpec
from shardflow.config import Settings
from shardflow.errors import ClusterError, Error, UnknownTableError
from shardflow.runtime.coordinator.controller import Controller
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.coordinator.views import console_state, gauges
from shardflow.runtime.protocol import DrainReport, NewTable, NodeLoad, ShardKey, Workers
from shardflow.storage import RowRewrite
from shardflow.storage.partition import route
from shardflow.storage.shard_store import unfenced
from shardflow.telemetry.console import ConsoleServer
from shardflow.telemetry.devices import NodeProfile
from shardflow.telemetry.metrics import registry_for

log = logging.getLogger(__name__)
RETURNED_KEPT = 16
"""How many statements' ``RETURNING`` rows a coordinator keeps for retries, of at most
:data:`RETURNED_KEPT_BYTES` in all (a bigger answer is not kept)."""
RETURNED_KEPT_BYTES = 64 << 20
UNDECIDED_SWEEP_S = 30.0
"""How often the coordinator looks for changes of rows prepared on a node and never
decided (:meth:`CoordinatorNode.drop_undecided`); the first look comes one health interval
after it starts."""


class CoordinatorNode:
    """One coordinator: the catalog, the controller over ``workers``, and the console."""

    def __init__(self, state: CoordinatorState, workers: Workers, settings: Settings) -> None:
        self.state = state
        self.workers = workers
        self._change_locks: dict[str, threading.Lock] = {}
        self._change_locks_lock = threading.Lock()
        self._returned: OrderedDict[str, list[pa.Table]] = OrderedDict()
        """What the latest statements with ``RETURNING`` gave back, for one tried again
        after its answer was lost (:data:`RETURNED_KEPT` of them, in memory)."""
        self.settings = settings
        self.controller = Controller(state, workers, settings)
        self.registry, self.controller.recorder = registry_for(partial(gauges, self.controller))
        self.console = ConsoleServer(
            settings.metrics_port, self.registry, partial(console_state, self.controller)
        )
        self._hosts: dict[str, str] = {}
        """The Ray node of every worker seen (a node's worker never moves)."""
        self._hosts_lock = threading.Lock()
        self._stopped = threading.Event()

    @classmethod
    def open(
        cls,
        data_dir: str,
        settings: Settings,
        workers: Workers,
        owner: str | None = None,
        description: str = "",
    ) -> CoordinatorNode:
        """Take the data directory's lease (as ``owner``) and read its catalog."""
        return cls(CoordinatorState(data_dir, settings, owner, description), workers, settings)

    def start(self, restarted: bool = False) -> None:
        """Start the control loops: watch the workers, finish or roll back the moves a
        crash cut short. A coordinator ``restarted`` elsewhere adopts the running members."""
        self.controller.start()
        if restarted:
            self.controller.adopt()
        threading.Thread(target=self._sweep, name="undecided", daemon=True).start()

    def close(self) -> None:
        """Stop the loops and the console (an in-process coordinator; an actor's process
        ends with it)."""
        self._stopped.set()
        self.controller.stop()
        self.console.close()

    def _sweep(self) -> None:
        wait = self.settings.health_interval_s
        while not self._stopped.wait(wait):
            wait = UNDECIDED_SWEEP_S
            try:
                self.drop_undecided()
            except Exception:  # a sweep must never take the coordinator down
                log.exception("looking for undecided changes of rows failed")

    def drop_undecided(self) -> list[tuple[str, str, str]]:
        """Discard the changes of rows prepared on a node whose statement is neither
        committed nor running: the coordinator that ran it died before deciding (and no
        session tried it again), or a node missed the abort and its shards moved. Such a
        file holds its shard's checkpoints back (the log grows) until the table's next
        change. A statement running holds its group's change lock; one committed is put in
        effect by its node when told. Answers (node, table, statement) discarded."""
        found: set[tuple[str, str, str]] = set()
        for node in list(self.state.catalog.nodes):
            try:
                info = self.workers.get(node).info().get(self.settings.retry_deadline_s)
            except Error as error:
                log.info("%s not asked for undecided changes: %s", node, error)
                continue
            for shard in info.shards:
                found.update((node, shard.table, statement) for statement in shard.prepared)
            for replica in info.replicas:
                found.update((node, replica.table, statement) for statement in replica.prepared)
        dropped = []
        for node, table, statement in sorted(found):
            lock = self._changes_lock(table)
            if not lock.acquire(blocking=False):
                continue  # a change of the group runs: it decides its own parts
            try:
                spec = self.state.catalog.find_table(table)
                if spec is not None and spec.group in self.state.changing:
                    continue  # being changed (or truncated): that change decides
                if spec is not None and spec.change(statement) is not None:
                    continue  # committed: the node puts it in effect when told
                self.workers.get(node).abort_change(table, statement).get(
                    self.settings.retry_deadline_s
                )
                dropped.append((node, table, statement))
                log.warning("dropped %s's undecided change %s of %s", node, statement, table)
            except Error as error:
                log.info("undecided change %s on %s not dropped: %s", statement, node, error)
            finally:
                lock.release()
        return dropped

    # -- the catalog and its owner --------------------------------------------------------
    def catalog(self, tables: list[str] | None = None) -> dict[str, Any]:
        return self.state.catalog_json(tables)

    def owner_token(self) -> OwnerToken:
        return self.state.owner

    def register_nodes(self, nodes: list[str]) -> dict[str, Any]:
        return self.state.register_nodes(nodes)

    def report_profile(self, profile: NodeProfile) -> None:
        self.state.report_profile(profile)

    def release(self) -> None:
        """Stop the control loops and give the data directory up (before the workers stop):
        the next cluster on it takes it over at once."""
        self.controller.stop()
        self.state.release_lease()

    # -- tables -----------------------------------------------------------------------------
    def begin_create(self, table: NewTable) -> dict[str, Any]:
        return self.state.begin_create(table)

    def commit_create(self, name: str, rows: int) -> dict[str, Any]:
        return self.state.commit_create(name, rows)

    def announce(self, nodes: Sequence[str]) -> None:
        self.controller.announcer.announce(nodes)

    def abort_create(self, name: str) -> None:
        self.state.abort_create(name)

    def drop_table(self, name: str) -> tuple[dict[str, Any], str]:
        return self.state.drop_table(name)

    def delete_files(self, uid: str) -> None:
        self.state.delete_files(uid)

    def truncate_table(self, name: str) -> dict[str, Any]:
        """Empty the table ``name``: new files and the next commit number in the catalog,
        every node told and serving them before the answer (a query at the old commit
        that reaches a node after that runs again whole), then the old files deleted."""
        routing, old_uid = self.state.begin_truncate(name)
        try:
            self.controller.announcer.announce(self.state.catalog.nodes)
        finally:
            self.state.end_change(name)
        self.state.delete_files(old_uid)
        return routing

    def change_rows(
        self,
        name: str,
        statement: str,
        change: RowRewrite,
        buckets: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Change rows of ``name`` all or nothing, in two phases: every node owning its
        shards (those owning ``buckets``; None: all) prepares its part durably without putting it in
        effect; if one fails, every part is discarded and the error raised; else the
        decision is logged in the catalog (the commit point: the next commit number, the
        statement kept with it) and every node is told, each putting its parts in effect
        before it answers. One change of a group's rows at a time; moves of the group wait.
        A statement already committed is answered as it was (applied once); what one with
        ``RETURNING`` gave back is kept for the latest :data:`RETURNED_KEPT` such statements
        (in this coordinator's memory: tried again after a new coordinator took over, it
        says the rows it returned are lost; the change stays applied once)."""
        with self._changes_lock(name):
            spec = self.state.catalog.find_table(name)
            if spec is None:
                raise UnknownTableError(f"unknown table {name!r}")
            done = spec.change(statement)
            if done is not None:
                answer = {"rows": done.rows, "routing": self.state.catalog_json([spec.name])}
                if change.returning is None:
                    return answer
                if statement not in self._returned:
                    raise ClusterError(
                        f"statement {statement} was applied ({done.rows} rows) before, and "
                        "what its RETURNING gave is no longer kept: query the table for them"
                    )
                return {**answer, "returned": self._returned[statement]}
            spec = self.state.begin_change(spec.name, "changed")
            try:
                rows, returned = self._prepare(spec, statement, change, buckets)
                if not rows:
                    return {"rows": 0, "routing": self.state.catalog_json([spec.name])}
                deleted = rows if change.delete else 0
                if change.returning is not None:
                    self._keep_returned(statement, returned)
                routing = self.state.commit_change(spec.name, statement, rows, deleted)
                self.controller.announcer.announce(self.state.catalog.nodes)
            finally:
                self.state.end_change(spec.name)
            return {"rows": rows, "routing": routing, "returned": returned}

    def _keep_returned(self, statement: str, returned: list[pa.Table]) -> None:
        """Keep what ``statement`` gave back, dropping the oldest kept beyond
        :data:`RETURNED_KEPT` statements or :data:`RETURNED_KEPT_BYTES`."""
        self._returned[statement] = returned
        while self._returned and (
            len(self._returned) > RETURNED_KEPT
            or sum(t.nbytes for kept in self._returned.values() for t in kept) > RETURNED_KEPT_BYTES
        ):
            self._returned.popitem(last=False)

    def _prepare(
        self, spec: TableSpec, statement: str, change: RowRewrite, buckets: Sequence[int] | None
    ) -> tuple[int, list[pa.Table]]:
        """Every owner of ``spec``'s shards prepares its part (all at once); the rows
        changed, and what they give back (``RETURNING``). On any failure every part is
        discarded (on the nodes that answer) and the failure raised: nothing of the
        statement takes effect."""
        owned: dict[str, list[int] | None] = {}
        if spec.group is None:  # replicated: the copy that writes its log prepares
            primary = self.state.catalog.primary
            if primary is None:
                raise ClusterError(f"no node serves {spec.name}: the cluster has none")
            owned[primary] = None
        else:
            group = self.state.catalog.groups[spec.group]
            wanted = None
            if buckets is not None:  # the units that own them now (no move runs meanwhile)
                wanted = {int(u) for u in group.owners_of(np.asarray(buckets, np.int64))}
            for unit in group.units:
                if wanted is None or unit.unit_id in wanted:
                    owned.setdefault(unit.node, [])
                    owned[unit.node].append(unit.unit_id)  # type: ignore[union-attr]
        replies = [
            (
                node,
                self.workers.get(node).prepare_change(
                    spec.name, statement, spec.commit, change, None if ids is None else sorted(ids)
                ),
            )
            for node, ids in sorted(owned.items())
        ]
        rows = 0
        returned: list[pa.Table] = []
        failure: BaseException | None = None
        moving: list[tuple[pa.Table, np.ndarray]] = []
        for _, reply in replies:
            try:
                prepared = reply.get()
            except Error as error:
                failure = failure or error
                continue
            rows += sum(prepared.rows.values())
            returned.extend(prepared.returned)
            if prepared.moving is not None and prepared.buckets is not None:
                moving.append((prepared.moving, prepared.buckets))
        touched = set(owned)
        if moving and failure is None:  # an UPDATE of the key: rows go to their new shards
            try:
                touched |= self._prepare_moving(spec, statement, moving)
            except Error as error:
                failure = error
                touched = set(self.state.catalog.nodes)
        if failure is None or unfenced("atomic"):  # the test hook: commit what was prepared
            return rows, returned
        for node in sorted(touched):
            try:
                self.workers.get(node).abort_change(spec.name, statement).get()
            except Error as error:  # gone: its parts are never committed, nor applied
                log.info("abort of %s on %s skipped: %s", statement, node, error)
        raise failure

    def _prepare_moving(
        self, spec: TableSpec, statement: str, moving: list[tuple[pa.Table, np.ndarray]]
    ) -> set[str]:
        """Prepare the rows an UPDATE of the key moves on the shards that own their new
        keys; the nodes asked."""
        assert spec.group is not None
        rows = pa.concat_tables([table for table, _ in moving])
        buckets = np.concatenate([b for _, b in moving])
        group = self.state.catalog.groups[spec.group]
        by_node: dict[str, dict[int, tuple[pa.Table, np.ndarray]]] = {}
        for unit_id, part in route(rows, buckets, self.state.catalog, spec.group).items():
            by_node.setdefault(group.unit(unit_id).node, {})[unit_id] = part
        replies = [
            self.workers.get(node).prepare_rows(spec.name, statement, spec.commit, parts)
            for node, parts in sorted(by_node.items())
        ]
        for reply in replies:
            reply.get()
        return set(by_node)

    def _changes_lock(self, name: str) -> threading.Lock:
        """The lock one change of rows of ``name``'s co-location group holds."""
        spec = self.state.catalog.find_table(name)
        key = (spec.group or spec.name) if spec is not None else name
        with self._change_locks_lock:
            return self._change_locks.setdefault(key, threading.Lock())

    def set_grants(self, name: str, grants: list[list[str]]) -> dict[str, Any]:
        return self.state.set_grants(name, grants)

    # -- cluster operations -----------------------------------------------------------------
    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_move(unit_id, to))

    def split(self, unit_id: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_split(unit_id))

    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_merge(first, second))

    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        return self.controller.rebalance(dry_run)

    def cancel(self, move_id: str) -> dict[str, Any]:
        return self.controller.cancel(move_id)

    def pause_balancer(self, paused: bool) -> bool:
        return self.controller.pause_balancer(paused)

    def reserve_node(self) -> str:
        return self.state.reserve_node()

    def node_joined(self, node: str) -> dict[str, Any]:
        return self.state.node_joined(node)

    def admitted(self, node: str, host: str) -> None:
        """A worker started for ``node`` on the Ray node ``host`` serves: it joins, and every
        worker learns of it."""
        with self._hosts_lock:
            self._hosts[node] = host
        self.state.node_joined(node)
        self.controller.broadcast(wait=False)

    def drain(self, node: str, deadline_s: float) -> DrainReport:
        return self.controller.drain(node, deadline_s)

    def cancel_drain(self, node: str) -> bool:
        return self.controller.cancel_drain(node)

    def drain_host(self, host: str, deadline_s: float) -> list[DrainReport]:
        """Drain every live worker on the Ray node ``host`` and stop those drained (a dead
        one is failed over by the watch loop)."""
        reports = []
        for node, found in self.hosts().items():
            if found == host and self._answers(node):
                report = self.controller.drain(node, deadline_s)
                if report.drained:
                    self.workers.stop(node)
                reports.append(report)
        return reports

    def hosts(self) -> dict[str, str]:
        """The Ray node of every member (a member whose worker died counts until the watch
        loop fails it over). A member's worker is asked once; one that does not answer is
        left out."""
        hosts = {}
        for node in self.state.catalog.nodes:
            with self._hosts_lock:
                known = self._hosts.get(node)
            if known is None:
                try:
                    info = self.workers.get(node).info().get(self.settings.retry_deadline_s)
                except Error:
                    continue
                known = info.host.ray_node_id
                with self._hosts_lock:
                    self._hosts[node] = known
            hosts[node] = known
        return hosts

    def _answers(self, node: str) -> bool:
        try:
            return self.workers.get(node).ping().get(self.settings.retry_deadline_s)
        except Error:
            return False

    # -- reports ----------------------------------------------------------------------------
    def migrations(self) -> list[dict[str, Any]]:
        return self.controller.history()

    def failovers(self) -> list[dict[str, Any]]:
        return [vars(f) for f in self.controller.failovers]

    def metrics_url(self) -> str:
        return f"{self.console.url}metrics"

    def node_loads(self) -> dict[str, NodeLoad]:
        return self.controller.node_loads()

    def shard_loads(self) -> dict[ShardKey, float]:
        return dict(self.controller.shard_load)

    def record_outcomes(self, queries: list[tuple[float, bool]], inserts: list[int]) -> None:
        """Queries' (seconds, succeeded) and inserts' row counts, sent in batches by each
        session."""
        if queries or inserts:  # moves yield to them (``migration_share``)
            self.controller.migrator.foreground()
        recorder = self.controller.recorder
        if recorder is not None:
            for seconds, ok in queries:
                recorder.query(seconds, ok)
            for rows in inserts:
                recorder.insert(rows)

    def record_access(self, denied_action: str | None) -> None:
        if self.controller.recorder is not None:
            self.controller.recorder.access(denied_action)
