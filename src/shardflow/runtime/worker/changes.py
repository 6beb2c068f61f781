"""A worker's part in the changes of a table's rows: the commit every fragment and insert
was routed at, checked (``TRUNCATE``, ``DELETE`` and ``UPDATE`` give a table its next), and
a change of rows (``DELETE``, ``UPDATE``): preparing it in the
node's shards, durably and not in effect, the rows an UPDATE of the key brings from other
shards, and discarding what was prepared when the statement is aborted (the coordinator's
two phases: ``runtime/coordinator/node.CoordinatorNode.change_rows``). Putting a committed
change in effect is the catalog's to say (``serving.CatalogServing``). A part of
:class:`~shardflow.runtime.worker.node.WorkerNode` (a mixin: the node's shards, lock and
catalog are its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import duckdb
import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.engine import query_error
from shardflow.errors import Changed, Moved
from shardflow.runtime.protocol import REPLICA, PreparedChange, ShardKey
from shardflow.storage import RowRewrite, Shard
from shardflow.storage.partition import buckets_for
from shardflow.storage.shard_store import unfenced


class RowChanges:
    """Changes of rows in this node's shards (see the module)."""

    catalog: Catalog
    lock: threading.RLock
    shards: dict[ShardKey, Shard]
    replicas: dict[str, Shard]

    # -- the commit a fragment or insert was routed at ------------------------------------
    def _same_files(
        self, checked: Mapping[str, TableSpec], table: str, shard: Shard, epoch: int
    ) -> None:
        """An insert checked against a table's commit (``checked``) appends to a shard of
        that very commit: ``Changed`` where a truncate put the shard in place between the
        check and the lookup (a node switches its shards before its catalog), ``Moved``
        where the shard holds files older than the table's (:func:`stale_files`)."""
        spec = checked.get(table)
        if spec is None or shard.store.table_uid == spec.uid or unfenced("commits"):
            return
        now = self.catalog.tables.get(table)
        stale = stale_files(shard, now, epoch)
        if stale is not None or now is None:
            raise stale or Moved(f"{table} (dropped)", epoch)
        raise Changed(table, spec.commit, now.commit)

    def check_commits(self, commits: Mapping[str, int], epoch: int) -> dict[str, TableSpec]:
        """Refuse a fragment or insert routed at another commit of a table than this node
        serves: an older one with ``Changed`` (the rows it would read or add to are gone:
        the caller starts over), a newer one with ``Moved`` (this node has not been told
        the change yet: the caller tries again). Answers the tables as checked."""
        checked = {}
        tables = self.catalog.tables
        for table, commit in commits.items():
            spec = tables.get(table)
            if spec is None:
                continue
            checked[table] = spec
            if spec.commit == commit or unfenced("commits"):
                continue
            if spec.commit > commit:
                raise Changed(table, commit, spec.commit)
            raise Moved(f"{table} at commit {commit}", epoch)
        return checked

    # -- changes of rows, in two phases --------------------------------------------------
    def prepare_change(
        self,
        table: str,
        statement: str,
        commit: int,
        change: RowRewrite,
        units: Sequence[int] | None = None,
    ) -> PreparedChange:
        """Prepare ``statement``'s change of this node's shards of ``table`` (those of
        ``units``; None: all; a replicated table's copy where this node writes its log),
        each durably and not in effect (``Shard.prepare_change``);
        answers the rows each changes. ``commit``: the table's commit number the statement
        was planned at (``Changed`` where this node serves another). If one shard fails,
        those prepared here are discarded and the error is raised."""
        epoch = self.catalog.epoch
        self.check_commits({table: commit}, epoch)
        with self.lock:
            shards: dict[int | str, Shard] = {
                unit: shard
                for (name, unit), shard in self.shards.items()
                if name == table and (units is None or unit in units)
            }
            replica = self.replicas.get(table)
            if replica is not None:  # a replicated table: its writing copy (the log's)
                if not replica.writer:
                    raise Moved(f"{table} (replica): this node writes no log", epoch)
                shards = {REPLICA: replica}
        missing = set(units or ()) - set(shards)
        if missing:
            raise Moved(f"{table}#{min(missing)}", epoch)
        counts: dict[int | str, int] = {}
        moving: list[pa.Table] = []
        returned: list[pa.Table] = []
        try:
            for unit, shard in sorted(shards.items(), key=lambda item: str(item[0])):
                keeps = self._keeps(table, unit) if change.key is not None else None
                counts[unit], leaving, gives = shard.prepare_change(statement, change, keeps)
                if leaving is not None and leaving.num_rows:
                    moving.append(leaving)
                if gives is not None:
                    returned.append(gives)
        except BaseException as error:
            for shard in shards.values():
                shard.discard_prepared(statement)
            if isinstance(error, duckdb.Error):  # a value that does not fit, as DuckDB says
                raise query_error(error) from None
            raise
        if not moving:
            return PreparedChange(counts, returned=tuple(returned))
        moved = pa.concat_tables(moving)
        spec = self.catalog.table(table)
        buckets = buckets_for(moved, spec, self.catalog.n_buckets)
        return PreparedChange(counts, moved, buckets, tuple(returned))

    def _keeps(self, table: str, unit: int | str) -> Callable[[pa.Table], np.ndarray]:
        """Which rows (new values of an UPDATE of the key) the unit ``unit`` of ``table``
        owns: the others leave it."""
        spec = self.catalog.table(table)
        assert spec.group is not None and isinstance(unit, int)
        owned = self.catalog.groups[spec.group].unit(unit)
        n_buckets = self.catalog.n_buckets

        def keeps(rows: pa.Table) -> np.ndarray:
            buckets = buckets_for(rows, spec, n_buckets)
            return np.asarray((buckets >= owned.lo) & (buckets < owned.hi))

        return keeps

    def prepare_rows(
        self,
        table: str,
        statement: str,
        commit: int,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
    ) -> None:
        """Prepare rows ``statement`` moves into this node's shards of ``table`` (per unit,
        rows and their buckets: an UPDATE of the key), each durably and not in effect."""
        epoch = self.catalog.epoch
        self.check_commits({table: commit}, epoch)
        with self.lock:
            shards = {unit: self.shards.get((table, unit)) for unit in parts}
        for unit, shard in shards.items():
            if shard is None:
                raise Moved(f"{table}#{unit}", epoch)
        for unit, (rows, buckets) in parts.items():
            shard = shards[unit]
            assert shard is not None
            shard.prepare_entry(statement, rows, np.asarray(buckets))

    def abort_change(self, table: str, statement: str) -> None:
        """Discard the change ``statement`` prepared in this node's shards of ``table``."""
        with self.lock:
            shards = [shard for (name, _), shard in self.shards.items() if name == table]
            if table in self.replicas:
                shards.append(self.replicas[table])
        for shard in shards:
            shard.discard_prepared(statement)


def stale_files(shard: Shard, spec: TableSpec | None, epoch: int) -> Moved | None:
    """``Moved`` where ``shard`` holds other files than the table's current ones (``spec``):
    the copy a move made of files a truncate has replaced since, served until this node is
    told of the switch. None where they are the same (or the table is unknown here)."""
    if spec is None or shard.store.table_uid == spec.uid or unfenced("commits"):
        return None
    return Moved(f"{spec.name} (a shard of files {shard.store.table_uid[:8]})", epoch)
