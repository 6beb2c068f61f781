"""The coordinator: the control plane. It owns the catalog (tables, units, routing epoch),
persists every change, and decides placement with the pure policies in ``control/``.
Queries and inserts never pass through it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from shardflow.catalog import (
    Catalog,
    CatalogStore,
    DataDir,
    OwnerToken,
    TableSpec,
    Unit,
    lease,
    name_key,
    version,
)
from shardflow.catalog.buckets import key_family
from shardflow.catalog.grants import SHARED
from shardflow.catalog.store import PreparedChange
from shardflow.config import Settings
from shardflow.control.migration import MoveKind, MovePlan, UnitSpan
from shardflow.control.placement import initial_unit_count, node_capacities, place_units
from shardflow.errors import (
    ClusterError,
    Error,
    MoveRefusedError,
    TableError,
    TableExistsError,
    UnknownShardError,
    UnknownTableError,
)
from shardflow.runtime.protocol import NewTable
from shardflow.telemetry.devices import NodeProfile

log = logging.getLogger(__name__)
TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CHANGES_KEPT = 10_000
"""Catalog changes kept in memory to tell workers of: a node whose catalog is older than
the oldest is sent the catalog whole."""

CREATE_WAITS_FOR_MOVES_S = 600.0
"""How long creating a table co-located with others waits for splits and merges of their
shards to end."""


@dataclass(frozen=True)
class PendingTable:
    spec: TableSpec
    catalog: Catalog
    """The catalog as it will be once the table is committed (new group included)."""


class CoordinatorState:
    """The coordinator's logic, independent of Ray (the actor wraps it)."""

    def __init__(
        self,
        data_dir: str,
        settings: Settings,
        owner: str | None = None,
        description: str = "",
    ) -> None:
        # One owner per data directory: take its lease before reading anything, and write
        # only as that owner (every durable write checks the token).
        plain = DataDir.resolve(data_dir)
        owner = owner or f"cluster-{uuid.uuid4().hex}"
        self.owner: OwnerToken = lease.acquire(plain, owner, settings.lease_ttl_s, description)
        self.data_dir = plain.fenced(self.owner)
        try:  # a format newer than this release reads is refused before anything is read
            version.open_format(self.data_dir)
        except Exception:
            lease.release(plain, self.owner)
            raise
        self.store = CatalogStore(self.data_dir)
        self.settings = settings
        self.catalog = self.store.load() or Catalog(n_buckets=settings.buckets)
        self.store.discard_all_prepared()  # an owner before this one prepared them
        self._changes: deque[dict[str, Any]] = deque(maxlen=CHANGES_KEPT)
        """The latest changes of the catalog, which workers are told of as they concern
        them (``runtime/coordinator/announce.py``)."""
        self.pending: dict[str, PendingTable] = {}
        self.profiles: dict[str, NodeProfile] = {}
        """Every live worker's device profile and calibration, as it reported them."""
        self.operator_mix: dict[str, float] = {}
        """The cluster's load by calibrated operator over the last observed window (shares;
        empty until the controller has observed one)."""
        self.moving: dict[str, MovePlan] = {}
        self.waiting_moves: Counter[str] = Counter()
        """Moves asked for, per group, waiting for a change of its rows to end: the next
        change waits for them to start (:meth:`_wait_out_changes`)."""
        self.changing: dict[str, tuple[str, str]] = {}
        """Groups one of whose tables is being truncated or having rows changed: that
        table, and what is done to it. No move of theirs starts until every node serves the
        table as changed (:meth:`begin_change`)."""
        self._unit_ids_taken = self.catalog.next_unit_id
        """Unit ids handed to tables being created: taken, though not yet in the catalog
        (a create that fails leaves no catalog change behind)."""
        self._lock = threading.RLock()
        self._moves_ended = threading.Condition(self._lock)
        self._remove_orphaned_files()

    def _remove_orphaned_files(self) -> None:
        """Table folders no catalog entry points at: left by a crash during a load or drop."""
        folder = self.data_dir.path("tables")
        infos = self.data_dir.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
        known = {spec.uid for spec in self.catalog.tables.values()}
        for info in infos:
            if info.type == pafs.FileType.Directory and info.base_name not in known:
                log.info("removing orphaned table files %s", info.path)
                self.data_dir.delete_dir(info.path)

    def renew_lease(self) -> bool:
        """Extend the data directory's lease; False once another cluster took it over."""
        return lease.renew(self.data_dir, self.owner)

    def release_lease(self) -> None:
        """Give the data directory up (a clean shutdown): the next cluster takes it at once."""
        lease.release(self.data_dir, self.owner)

    def _save(self, catalog: Catalog, tables: Sequence[str] | None = None) -> dict[str, Any]:
        """:meth:`_commit`, answering the catalog whole, or only the routing of ``tables``
        (what a session that changed them needs: a table made or dropped costs what the
        table is, not what the cluster is)."""
        self._commit(catalog)
        return (catalog if tables is None else catalog.routing(tables)).to_json()

    def _commit(self, catalog: Catalog, prepared: PreparedChange | None = None) -> None:
        """Make ``catalog`` the current version, saved as a change (kept for
        :meth:`changes_since`); ``prepared``: see :meth:`CatalogStore.save`."""
        change = self.store.save(catalog, prepared)
        if change is None:  # saved whole: no change leads to it
            self._changes.clear()
        else:
            self._changes.append(change)
        self.catalog = catalog

    def changes_since(self, version: int) -> list[dict[str, Any]] | None:
        """The changes made after ``version``, oldest first (empty: none); None where
        they are not all kept (``CHANGES_KEPT``)."""
        with self._lock:
            if version == self.catalog.version:
                return []
            changes = list(self._changes)
        for index, change in enumerate(changes):
            if change["base"] == version:
                return changes[index:]
        return None

    def catalog_json(self, tables: Sequence[str] | None = None) -> dict[str, Any]:
        """The catalog whole, or only the routing of ``tables`` (:meth:`Catalog.routing`)."""
        with self._lock:
            catalog = self.catalog
        return (catalog if tables is None else catalog.routing(tables)).to_json()

    # -- nodes --------------------------------------------------------------------------
    def register_nodes(self, nodes: list[str]) -> dict[str, Any]:
        """Declare the live nodes; units on nodes that are gone get new owners."""
        with self._lock:
            orphans = self.catalog.orphaned_units(nodes)
            current = Counter(
                u.node for g in self.catalog.groups.values() for u in g.units if u.node in nodes
            )
            owners = place_units(len(orphans), self.placement_capacities(nodes), current)
            placement = {unit.unit_id: owner for unit, owner in zip(orphans, owners, strict=True)}
            if orphans:
                log.info("reassigning %d units of departed nodes", len(orphans))
            if set(nodes) == set(self.catalog.nodes) and not orphans:
                return self.catalog.to_json()
            return self._save(self.catalog.with_nodes(nodes, placement))

    def reserve_node(self) -> str:
        """A new node id (never reused, even after the node is gone)."""
        with self._lock:
            node = f"node-{self.catalog.next_node_index}"
            self._save(self.catalog._next(next_node_index=self.catalog.next_node_index + 1))
            return node

    def node_joined(self, node: str) -> dict[str, Any]:
        with self._lock:
            return self._save(self.catalog.with_node_added(node))

    def node_left(self, node: str) -> dict[str, Any] | None:
        """A node died or was drained: its units (if any) get new owners. None if it was not
        a member any more."""
        with self._lock:
            if node not in self.catalog.nodes:
                return None
            for move in self.moving.values():
                if node in move.nodes:
                    log.info("node %s left during move %s", node, move.move_id)
            return self.register_nodes([n for n in self.catalog.nodes if n != node])

    # -- moves --------------------------------------------------------------------------
    def _find_unit(self, unit_id: int) -> tuple[str, Unit]:
        for group in self.catalog.groups.values():
            for unit in group.units:
                if unit.unit_id == unit_id:
                    return group.group_id, unit
        raise UnknownShardError(f"no shard unit {unit_id}; see db.cluster.shards()")

    def _wait_out_changes(self, group_of: Callable[[], str], wait: bool = True) -> None:
        """Wait (the lock released meanwhile) while a table of the group ``group_of()``
        names is being changed: the move starts once it ends, before the next change of the
        group begins (:meth:`begin_change` lets waiting moves go first).
        ``MoveRefusedError`` after :data:`CREATE_WAITS_FOR_MOVES_S`, or at once without
        ``wait``: the balancer reserves all the moves of a decision before it runs any, and
        a change waits for the moves reserved, so one of them must not wait for it."""
        deadline = time.monotonic() + (CREATE_WAITS_FOR_MOVES_S if wait else 0.0)
        while (group := group_of()) in self.changing:
            left = deadline - time.monotonic()
            if left <= 0:
                table, what = self.changing[group]
                raise MoveRefusedError(
                    f"table {table!r} kept being {what} for {CREATE_WAITS_FOR_MOVES_S:g} s; "
                    "move its shards once it is done"
                )
            self.waiting_moves[group] += 1
            try:
                self._moves_ended.wait(left)
            finally:
                self.waiting_moves[group] -= 1
                self._moves_ended.notify_all()

    def _reserve(
        self,
        kind: MoveKind,
        group: str,
        sources: list[Unit],
        targets: list[tuple[int, int, str]],
        reason: str,
    ) -> MovePlan:
        busy = {u.unit_id for move in self.moving.values() for u in move.sources}
        if busy & {u.unit_id for u in sources}:
            raise MoveRefusedError(f"unit(s) {sorted(busy)} are already being moved")
        # a split or merge copies the group's tables as they are when it begins: a table
        # being loaded into the group has shards it would leave behind (a plain move keeps
        # the unit's id and files, and the new owner serves every table from them)
        if group in self.changing:
            table, what = self.changing[group]
            raise MoveRefusedError(
                f"table {table!r} is being {what}; move unit(s) "
                f"{sorted(u.unit_id for u in sources)} once it is done"
            )
        creating = sorted(p.spec.name for p in self.pending.values() if p.spec.group == group)
        if creating and kind != "move":
            raise MoveRefusedError(
                f"table(s) {creating} are being created co-located with unit(s) "
                f"{sorted(u.unit_id for u in sources)}; {kind} them once the load is done"
            )
        if kind == "move":  # a moved unit keeps its id, and its durable files with it
            ids = [sources[0].unit_id]
        else:
            catalog, ids = self._past_taken_ids().with_unit_ids_reserved(len(targets))
            self._commit(catalog)
        plan = MovePlan(
            move_id=uuid.uuid4().hex[:12],
            kind=kind,
            group=group,
            sources=tuple(UnitSpan(u.unit_id, u.lo, u.hi, u.node) for u in sources),
            targets=tuple(
                UnitSpan(i, lo, hi, node) for i, (lo, hi, node) in zip(ids, targets, strict=True)
            ),
            reason=reason,
        )
        self.moving[plan.move_id] = plan
        return plan

    def plan_move(
        self, unit_id: int, to: str, reason: str = "requested", wait: bool = True
    ) -> MovePlan:
        """Reserve a move of ``unit_id`` to ``to`` (see :meth:`_wait_out_changes` for
        ``wait``)."""
        with self._lock:
            self._wait_out_changes(lambda: self._find_unit(unit_id)[0], wait)
            group, unit = self._find_unit(unit_id)
            if to not in self.catalog.nodes:
                raise MoveRefusedError(f"{to!r} is not a node of the cluster")
            if unit.node == to:
                raise MoveRefusedError(f"unit {unit_id} is already on {to}")
            return self._reserve("move", group, [unit], [(unit.lo, unit.hi, to)], reason)

    def plan_split(self, unit_id: int, reason: str = "requested", wait: bool = True) -> MovePlan:
        with self._lock:
            self._wait_out_changes(lambda: self._find_unit(unit_id)[0], wait)
            group, unit = self._find_unit(unit_id)
            if unit.buckets < 2:
                raise MoveRefusedError(f"unit {unit_id} holds one bucket and cannot be split")
            middle = unit.lo + unit.buckets // 2
            halves = [(unit.lo, middle, unit.node), (middle, unit.hi, unit.node)]
            return self._reserve("split", group, [unit], halves, reason)

    def plan_merge(
        self, first: int, second: int, reason: str = "requested", wait: bool = True
    ) -> MovePlan:
        with self._lock:
            self._wait_out_changes(lambda: self._find_unit(first)[0], wait)
            group_a, a = self._find_unit(first)
            group_b, b = self._find_unit(second)
            if group_a != group_b or not (a.hi == b.lo or b.hi == a.lo):
                raise MoveRefusedError(f"units {first} and {second} are not adjacent")
            low, high = sorted((a, b), key=lambda u: u.lo)
            return self._reserve("merge", group_a, [low, high], [(low.lo, high.hi, a.node)], reason)

    def switched(self, plan: MovePlan) -> bool:
        """Whether the catalog routes the move's buckets to its targets already."""
        group = self.catalog.groups.get(plan.group)
        present = {u.unit_id: u.node for u in group.units} if group is not None else {}
        return all(present.get(t.unit_id) == t.node for t in plan.targets)

    def prepare_switch(self, plan: MovePlan) -> PreparedChange | None:
        """Write ahead the catalog change :meth:`apply_switch` would make now
        (``CatalogStore.prepare``), so that the switch, while writers wait, only renames
        it; None where it cannot be (the switch then writes its change whole)."""
        try:
            with self._lock:
                switched = self._switched_catalog(plan)
            return self.store.prepare(switched)  # synced: not under the lock
        except (Error, OSError) as error:  # the switch writes it, or fails, itself
            log.info("the switch of %s is not prepared: %s", plan.move_id, error)
            return None

    def discard(self, prepared: PreparedChange) -> None:
        """A prepared switch that was not used (the move rolled back)."""
        with contextlib.suppress(Error, OSError):
            self.store.discard(prepared)

    def apply_switch(self, plan: MovePlan, prepared: PreparedChange | None = None) -> None:
        """Route the moved buckets to the targets (epoch bump, persisted). Idempotent.
        ``prepared``: the change :meth:`prepare_switch` wrote, where it still fits."""
        with self._lock:
            if self.switched(plan):
                if prepared is not None:
                    self.discard(prepared)
                return
            self._commit(self._switched_catalog(plan), prepared)

    def _switched_catalog(self, plan: MovePlan) -> Catalog:
        """The catalog with the moved units on their targets."""
        group = self.catalog.groups.get(plan.group)
        current = {u.unit_id: u for u in group.units} if group is not None else {}
        for source in plan.sources:
            unit = current.get(source.unit_id)
            if unit is None or unit.node != source.node:
                raise MoveRefusedError(f"unit {source.unit_id} changed owner during the move")
        added = [Unit(t.unit_id, t.lo, t.hi, t.node) for t in plan.targets]
        removed = [s.unit_id for s in plan.sources]
        return self.catalog.with_units_replaced(plan.group, removed, added)

    def reserve_move(self, plan: MovePlan) -> None:
        """Count ``plan`` as running (a previous coordinator's, not resumed yet): its units
        are refused to other moves until :meth:`finish_move`."""
        with self._lock:
            self.moving[plan.move_id] = plan

    def finish_move(self, plan: MovePlan) -> None:
        with self._lock:
            self.moving.pop(plan.move_id, None)
            self._moves_ended.notify_all()

    def report_profile(self, profile: NodeProfile) -> None:
        with self._lock:
            self.profiles[profile.node_id] = profile

    def capacities(self, nodes: list[str]) -> dict[str, float]:
        """Each node's capacity for the cluster's current operator mix, relative to the
        median node (``control/placement.node_capacities``): what placement, the balancer
        and ``db.cluster.nodes()`` use."""
        return node_capacities(nodes, self.profiles, self.operator_mix)

    @property
    def excluded(self) -> frozenset[str]:
        """Nodes that get no new units or work (suspect or failing: ``control/health.py``)."""
        return frozenset(self.catalog.excluded)

    def exclude(self, nodes: frozenset[str]) -> bool:
        """Make ``nodes`` the excluded ones; whether that changed the catalog (to announce)."""
        with self._lock:
            if frozenset(nodes) & set(self.catalog.nodes) == self.excluded:
                return False
            self._commit(self.catalog.with_excluded(nodes))
            return True

    def placement_capacities(self, nodes: list[str]) -> dict[str, float]:
        """:meth:`capacities` of the nodes that may receive units: not the excluded ones
        (unless every node is)."""
        serving = [n for n in nodes if n not in self.excluded] or nodes
        return self.capacities(serving)

    # -- tables -------------------------------------------------------------------------
    def begin_create(self, table: NewTable) -> dict[str, Any]:
        """Reserve the table's name and plan its units (as many as
        :func:`initial_unit_count` says for a source of its ``size_bytes``; None: unknown);
        nothing is visible until :meth:`commit_create`."""
        name, kind, key, colocate_with = table.name, table.kind, table.key, table.colocate_with
        key_index, size_bytes = table.key_index, table.size_bytes
        schema = pa.ipc.read_schema(pa.py_buffer(table.schema))
        with self._lock:
            if colocate_with is not None:
                self._wait_for_moves_of(colocate_with, name)
            if not TABLE_NAME.match(name):
                raise TableError(
                    f"invalid table name {name!r}: use letters, digits and underscores, "
                    "not starting with a digit"
                )
            existing = self.catalog.find_table(name)
            if existing is None and name_key(name) in self.pending:
                existing = self.pending[name_key(name)].spec
            if existing is not None:
                raise TableExistsError(
                    f"table {name!r} already exists as {existing.name!r} (names match "
                    "case-insensitively, as in DuckDB); drop it first or choose another name"
                )
            catalog = self.catalog
            group = None
            if kind == "distributed":
                if colocate_with is not None:
                    group = self._colocation_group(colocate_with, schema, key)
                else:
                    nodes = list(catalog.nodes)
                    if not nodes:
                        raise TableError("the cluster has no workers to place shards on")
                    current = Counter(u.node for g in catalog.groups.values() for u in g.units)
                    count = initial_unit_count(
                        self.settings.shards_per_worker,
                        len(nodes),
                        size_bytes,
                        self.settings.initial_shard_bytes,
                    )
                    owners = place_units(
                        count,
                        self.placement_capacities(nodes),
                        current,
                    )
                    key_type = schema.field(key).type if key else pa.int64()
                    catalog, group = self._past_taken_ids().with_new_group(key_type, owners)
                    # the unit ids are taken now, so concurrent creates never share one
                    self._unit_ids_taken = catalog.next_unit_id
            spec = TableSpec(
                name,
                uuid.uuid4().hex,
                schema,
                "distributed" if kind == "distributed" else "replicated",
                (key or "") if kind == "distributed" else None,
                group,
                key_index=key_index,
                grants=SHARED if table.grants is None else tuple(sorted(table.grants)),
                # past every commit a table of this name had before (each of them was a
                # catalog version): a node not yet told the table was made again says so
                # (Moved) rather than serve the one before at a commit number they share
                commit=catalog.version + 1,
            )
            catalog = catalog.with_table(spec)
            self.pending[name_key(name)] = PendingTable(spec, catalog)
            return catalog.routing([spec.name]).to_json()  # the new table's units, no other

    def _wait_for_moves_of(self, table: str, creating: str) -> None:
        """Wait (the lock released meanwhile) until no split or merge of ``table``'s
        co-location group is in flight: it copies the group's tables as they were when it
        began, so a table loaded into the group meanwhile would be left behind (its rows
        lost). Splits and merges of the group are refused from then until the table is
        committed or aborted (:meth:`_reserve`)."""

        def ended() -> bool:
            spec = self.catalog.find_table(table)
            if spec is None or spec.group is None:
                return True  # the checks that follow refuse it
            return not any(p.group == spec.group and p.kind != "move" for p in self.moving.values())

        moves = f"splits and merges of {table!r}'s shards"
        self._wait_for_moves(ended, f"creating {creating!r}", moves)

    def _wait_for_moves(self, ended: Callable[[], bool], waiting: str, moves: str) -> None:
        """Wait (the lock released meanwhile) until ``ended()``: ``ClusterError`` after
        :data:`CREATE_WAITS_FOR_MOVES_S`, saying that ``waiting`` waited for ``moves``."""
        deadline = time.monotonic() + CREATE_WAITS_FOR_MOVES_S
        while not ended():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(
                    f"{waiting} waited {CREATE_WAITS_FOR_MOVES_S:g} s for the {moves} to end; "
                    "try again"
                )
            self._moves_ended.wait(left)

    def _past_taken_ids(self) -> Catalog:
        """The catalog, counting the unit ids of creates in progress as used."""
        if self._unit_ids_taken <= self.catalog.next_unit_id:
            return self.catalog
        return dataclasses.replace(self.catalog, next_unit_id=self._unit_ids_taken)

    def _colocation_group(self, other: str, schema: pa.Schema, key: str | None) -> str:
        spec = self.catalog.find_table(other)
        if spec is None:
            raise UnknownTableError(f"colocate_with names unknown table {other!r}")
        if not spec.distributed or spec.group is None:
            raise TableError(f"cannot co-locate with {other!r}: it is replicated")
        if not spec.key or not key:
            raise TableError("co-located tables need a distribution column on both sides")
        group = self.catalog.groups[spec.group]
        family = key_family(schema.field(key).type)
        if family != group.key_family:
            raise TableError(
                f"cannot co-locate {key!r} ({schema.field(key).type}) with {other}.{spec.key} "
                f"({spec.schema.field(spec.key).type}): keys must hash alike "
                f"({family} vs {group.key_family})"
            )
        return spec.group

    def commit_create(self, name: str, rows: int) -> dict[str, Any]:
        with self._lock:
            pending = self.pending[name_key(name)]
            catalog = self.catalog
            spec = pending.spec
            if spec.group is not None and spec.group in catalog.groups:
                loaded = _spans(pending.catalog.groups[spec.group].units)
                if _spans(catalog.groups[spec.group].units) != loaded:  # the load aborts
                    raise ClusterError(
                        f"the shards {name!r} was loaded into were split or merged meanwhile; "
                        "nothing was created: create it again"
                    )
            del self.pending[name_key(name)]
            if spec.group is not None and spec.group not in catalog.groups:
                catalog = catalog.with_group(
                    pending.catalog.groups[spec.group], pending.catalog.next_unit_id
                )
            return self._save(catalog.with_table(replace(spec, rows=rows)), [spec.name])

    def set_grants(self, name: str, grants: Sequence[Sequence[str]]) -> dict[str, Any]:
        """Replace the grants of the table ``name`` (``catalog/grants.py``); answers its
        routing."""
        with self._lock:
            spec = self.catalog.find_table(name)
            if spec is None:
                raise UnknownTableError(f"unknown table {name!r}")
            kept = tuple(sorted((str(g), str(p), str(s)) for g, p, s in grants))
            if kept == spec.grants:
                return self.catalog.routing([spec.name]).to_json()
            return self._save(self.catalog.with_table(replace(spec, grants=kept)), [spec.name])

    def abort_create(self, name: str) -> None:
        with self._lock:
            pending = self.pending.pop(name_key(name), None)
        if pending is not None:
            self.data_dir.delete_dir(self.data_dir.path("tables", pending.spec.uid))

    def drop_table(self, name: str) -> tuple[dict[str, Any], str]:
        with self._lock:
            spec = self.catalog.find_table(name)
            if spec is None:
                raise UnknownTableError(f"unknown table {name!r}")
            return self._save(self.catalog.without_table(spec.name), []), spec.uid

    def begin_truncate(self, name: str) -> tuple[dict[str, Any], str]:
        """Give the table ``name`` new, empty files and the next commit number; answers its
        routing and the uid of its old files. No move of its group runs meanwhile (see
        :meth:`begin_change`) until :meth:`end_change`."""
        with self._lock:
            spec = self.begin_change(name, "truncated")
            truncated = self.catalog.with_table_truncated(spec.name, uuid.uuid4().hex)
            return self._save(truncated, [spec.name]), spec.uid

    def begin_change(self, name: str, what: str) -> TableSpec:
        """Mark the table ``name`` as being ``what`` (truncated, changed): moves of its
        group running are waited for (a move's copy is of the rows before), and new ones
        are refused until :meth:`end_change`. Answers the table."""
        with self._lock:
            spec = self.catalog.find_table(name)
            if spec is None:
                raise UnknownTableError(f"unknown table {name!r}")
            group = spec.group
            if group is not None:
                self._wait_for_moves(
                    lambda: not self.waiting_moves[group] and group not in self.changing,
                    f"{spec.name!r}, being {what},",
                    f"moves of {spec.name!r}'s shards asked for",
                )
                if group in self.changing:
                    table, doing = self.changing[group]
                    raise TableError(
                        f"table {table!r} of the same shards is being {doing}; try again "
                        "once it is done"
                    )
                self.changing[group] = (spec.name, what)
                try:
                    self._wait_for_moves(
                        lambda: all(p.group != group for p in self.moving.values()),
                        f"{spec.name!r}, being {what},",
                        f"moves of {spec.name!r}'s shards",
                    )
                except BaseException:
                    del self.changing[group]
                    raise
            return spec

    def commit_change(self, name: str, statement: str, rows: int, deleted: int) -> dict[str, Any]:
        """Log the decision that ``statement`` changed ``rows`` of ``name``'s rows (the
        commit point of a change of rows): the next commit number, the statement kept with
        it. Answers the table's routing."""
        with self._lock:
            changed = self.catalog.with_rows_changed(name, statement, rows, deleted)
            return self._save(changed, [name])

    def end_change(self, name: str) -> None:
        """Every node serves the table as changed: its group may move again."""
        with self._lock:
            for group in [g for g, (table, _) in self.changing.items() if table == name]:
                del self.changing[group]
            self._moves_ended.notify_all()

    def delete_files(self, uid: str) -> None:
        self.data_dir.delete_dir(self.data_dir.path("tables", uid))


def _spans(units: tuple[Unit, ...] | list[Unit]) -> set[tuple[int, int, int]]:
    """A group's units by id and bucket range (a plain move changes neither: the unit's
    files go with it, and its new owner serves a table loaded into them)."""
    return {(u.unit_id, u.lo, u.hi) for u in units}
