"""What a worker serves, as the catalog says: the catalog whole (``sync``), or the changes
it is told (``follow``: ``catalog/delta.for_node``), each looked at for the shards it
gives, takes, makes or drops. A part of :class:`~shardflow.runtime.worker.node.WorkerNode`
(a mixin: the node's shards, lock and storage are its own)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardflow.catalog import Catalog, TableSpec, delta
from shardflow.errors import Moved
from shardflow.runtime.protocol import REPLICA, ShardKey
from shardflow.storage import Shard

if TYPE_CHECKING:
    from shardflow.runtime.worker.moves import TargetSide

log = logging.getLogger(__name__)


class CatalogServing:
    """Serving what the catalog gives this node (see the module)."""

    node_id: str
    catalog: Catalog
    lock: threading.RLock
    shards: dict[ShardKey, Shard]
    replicas: dict[str, Shard]
    loading: dict[str, dict[int | str, Shard]]
    target: TargetSide

    # the node's own (``WorkerNode``)
    def new_shard(self, spec: TableSpec, name: str, *, writer: bool) -> Shard:
        raise NotImplementedError

    def release(self, shard: Shard) -> None:
        raise NotImplementedError

    def release_when_read(self, key: ShardKey, shard: Shard, *, files: bool = False) -> None:
        raise NotImplementedError

    def _release_replica_when_idle(self, shard: Shard) -> None:
        raise NotImplementedError

    def refresh_view(self, table: str) -> None:
        raise NotImplementedError

    def finish_load(self, table: str) -> None:
        raise NotImplementedError

    def sync(self, catalog_json: Mapping[str, Any]) -> int:
        """Serve what ``catalog_json`` assigns to this node: load missing shards, drop others."""
        return self.serve(Catalog.from_json(catalog_json))

    def follow(self, changes: Sequence[Mapping[str, Any]]) -> int:
        """Take the catalog's changes as this node is told them (``catalog/delta.for_node``:
        the coordinator tells a node of the moves, splits and merges that give or take its
        units, not of the others'): only the shards they give, take, make or drop are
        looked at, and the replicated tables after a change that concerns every node.
        Changes it has already (it was sent the catalog whole since) are passed over.
        Answers the version served, or -1 where this node's catalog is at another version
        than a change was made to (the coordinator then sends the catalog whole)."""
        with self.lock:
            try:
                catalog, applied = delta.follow(self.catalog, changes)
            except delta.ChangeError:
                return -1
            keys = delta.shards_touched(catalog, applied)
            dropped = delta.tables_dropped(applied)
            keys.update(key for key in self.shards if key[0] in dropped)
            everyone = any(delta.concerns_every_node(change) for change in applied)
            return self.serve(catalog, only=keys, replicas=everyone)

    def serve(
        self, catalog: Catalog, only: set[ShardKey] | None = None, replicas: bool = True
    ) -> int:
        """:meth:`sync` with the catalog read already (again with its own, after a move it
        was building shards for ends); with ``only``, just those shards are looked at (a
        change), and the replicated tables only with ``replicas``."""
        with self.lock:
            if catalog.version < self.catalog.version:
                return self.catalog.version
            self._finish_committed_loads(catalog)
            changed: set[str] = set()
            if only is None:
                wanted = {(r.table, r.unit_id) for r in catalog.shards_on(self.node_id)}
                held = list(self.shards)
            else:
                wanted = {key for key in only if self._owns(catalog, key)}
                held = [key for key in only if key in self.shards]
            for key in held:
                uid = self._uid(catalog, key[0])
                if key not in wanted or uid != self.shards[key].store.table_uid:
                    self.release_when_read(key, self.shards.pop(key))
                    changed.add(key[0])
                elif self._committed_here(catalog, key[0], self.shards[key]):
                    self._apply_changes(catalog, key)
                    changed.add(key[0])
            for table, unit_id in sorted(wanted - set(self.shards)):
                if self.target.building(table, unit_id):
                    continue  # built by a move in progress, served once it switches
                shard = self._take(catalog, table, str(unit_id), writer=True)
                if shard is not None:
                    self.shards[(table, unit_id)] = shard
                    changed.add(table)
            if only is None or replicas:
                changed |= self._serve_replicas(catalog)
            for table in changed:
                self.refresh_view(table)
            self.catalog = catalog
            return catalog.version

    def _finish_committed_loads(self, catalog: Catalog) -> None:
        """Serve the shards a load staged here whose table ``catalog`` holds (every node
        committed its part before the coordinator did; the session's ``finish_load``
        follows, or never comes if it died). Taking them from storage instead would make
        other copies of the same shards: their claim would fence the load's own copies,
        which the session's ``finish_load`` then serves, and every insert into them would
        be told ``Moved``."""
        for table, shards in list(self.loading.items()):
            spec = catalog.tables.get(table)
            if spec is not None and all(s.store.table_uid == spec.uid for s in shards.values()):
                self.finish_load(table)

    @staticmethod
    def _committed_here(catalog: Catalog, table: str, shard: Shard) -> bool:
        """Whether ``catalog`` holds a change of rows ``shard`` prepared as committed."""
        spec = catalog.tables.get(table)
        return spec is not None and any(spec.change(s) for s in shard.prepared)

    def _renew_replica(self, catalog: Catalog, name: str) -> None:
        """Make this node's copy of the replicated table ``name`` again from storage (a
        statement changed its rows); the copy before holds its appends meanwhile, then
        tells them ``Moved``, and is kept until no fragment runs here."""
        before = self.replicas.pop(name)
        try:
            shard = self._made_again(catalog, name, REPLICA, before)
        except BaseException:
            self.replicas[name] = before
            raise
        if shard is not None:
            self.replicas[name] = shard
        self._release_replica_when_idle(before)

    @staticmethod
    def _rows_changed_since(spec: TableSpec, shard: Shard) -> bool:
        """Whether a statement changed the rows of ``spec`` (a replicated table) since its
        copy ``shard`` was made."""
        return any(change.statement not in shard.committed for change in spec.changes)

    def _apply_changes(self, catalog: Catalog, key: ShardKey) -> None:
        """Put the committed changes a shard prepared in effect: the shard is made again
        from storage (its prepared file becomes its newest checkpoint, the log after it is
        replayed) and served from now on; the one before holds its appends meanwhile, then
        tells them ``Moved`` (they are placed again), and is kept for the fragments
        reading it. A fragment or an insert routed at the commit before is ``Changed``
        from the moment this node's catalog says the new one (it switches after this)."""
        before = self.shards[key]
        shard = self._made_again(catalog, key[0], str(key[1]), before)
        if shard is None:  # a copy given it at a later epoch holds it
            self.release_when_read(key, self.shards.pop(key))
            return
        self.shards[key] = shard
        self.release_when_read(key, before)

    def _made_again(self, catalog: Catalog, table: str, name: str, before: Shard) -> Shard | None:
        """The shard ``before`` made again from storage as ``catalog`` has it (None where
        a copy given it at a later epoch holds it); ``before`` holds its appends from now
        on (its caller releases it), or again takes them if this fails."""
        before.fence()
        try:
            return self._take(catalog, table, name, writer=before.writer)
        except BaseException:
            before.unfence()
            raise

    def _owns(self, catalog: Catalog, key: ShardKey) -> bool:
        spec = catalog.tables.get(key[0])
        if spec is None or spec.group is None or spec.group not in catalog.groups:
            return False
        units = catalog.groups[spec.group].units
        return any(u.unit_id == key[1] and u.node == self.node_id for u in units)

    def _serve_replicas(self, catalog: Catalog) -> set[str]:
        """Serve the replicated tables ``catalog`` has (the first node writes their log),
        let go of those it has not; answers the tables changed."""
        changed: set[str] = set()
        for name in list(self.replicas):
            spec = catalog.tables.get(name)
            if spec is None or spec.uid != self.replicas[name].store.table_uid:
                self.release(self.replicas.pop(name))
                changed.add(name)
            elif self._rows_changed_since(spec, self.replicas[name]):
                # every node's copy is made again from the files its log's writer changed
                self._renew_replica(catalog, name)
                changed.add(name)
        primary = self._is_primary(catalog)
        for spec in catalog.replicated_tables():
            if spec.name not in self.replicas:
                shard = self._take(catalog, spec.name, REPLICA, writer=primary)
                if shard is not None:
                    self.replicas[spec.name] = shard
                    changed.add(spec.name)
        for shard in self.replicas.values():
            if primary and not shard.writer:  # the log's writer from now on
                shard.claim(self.node_id, catalog.epoch)
            shard.writer = primary
        return changed

    def _take(self, catalog: Catalog, table: str, name: str, *, writer: bool) -> Shard | None:
        """A shard ``catalog`` gives this node, rebuilt from storage; a writer claims it
        first (any copy that wrote it before is fenced). None where a copy given it at a
        later epoch holds it: this node's catalog is older than that copy's."""
        shard = self.new_shard(catalog.table(table), name, writer=writer)
        try:
            if writer:
                shard.claim(self.node_id, catalog.epoch, recovering=True)
            shard.recover()
        except Moved as held:
            log.warning("%s: not served here: %s", self.node_id, held)
            self.release(shard)
            return None
        return shard

    def _uid(self, catalog: Catalog, table: str) -> str | None:
        spec = catalog.tables.get(table)
        return spec.uid if spec is not None else None

    def _is_primary(self, catalog: Catalog) -> bool:
        """The node that writes the log of replicated tables (the first live node)."""
        return catalog.primary == self.node_id
