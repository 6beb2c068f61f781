"""Creating a table: its definition checked against its source, its units planned by the
coordinator, its rows read once and staged on their workers batch by batch (over their fast
lanes where they have them), then committed; a load that fails leaves nothing behind."""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future

import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec, find_name
from shardflow.catalog.buckets import key_family
from shardflow.catalog.grants import Grant
from shardflow.catalog.types import storage_schema
from shardflow.config import Settings
from shardflow.errors import ClosedError, TableError, UnknownColumnError, WorkerTimeout
from shardflow.runtime.client.sources import arrow_size, open_source
from shardflow.runtime.fastlane import LaneBook, LaneBroken, to_wire
from shardflow.runtime.protocol import (
    REPLICA,
    Coordinator,
    NewTable,
    Reply,
    SharedRows,
    Workers,
)
from shardflow.storage.partition import split_by_unit

log = logging.getLogger(__name__)
MAX_IN_FLIGHT_LOADS = 8
"""Batches staged per node before the load waits for the workers to take them."""
Progress = Callable[[int, int | None], None]
"""Told the rows loaded so far and the source's rows (None where not known)."""


class Loader:
    """Loads new tables into the cluster, for a session."""

    def __init__(
        self,
        coordinator: Coordinator,
        workers: Workers,
        lanes: LaneBook,
        settings: Settings,
        closed: threading.Event,
    ) -> None:
        self.coordinator = coordinator
        self.workers = workers
        self.lanes = lanes
        self.settings = settings
        self.closed = closed

    def create(
        self,
        name: str,
        source: object,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
        progress: Progress | None = None,
        key_index: bool = False,
        grants: Sequence[Grant] | None = None,
    ) -> int:
        """Create ``name`` from ``source``; returns the rows loaded."""
        if not isinstance(name, str):
            raise TableError(f"a table name must be a string, not {type(name).__name__}")
        if replicated and (distributed_by is not None or colocate_with is not None):
            raise TableError("a replicated table takes neither distributed_by nor colocate_with")
        if colocate_with is not None and distributed_by is None:
            raise TableError("colocate_with needs distributed_by (the column to co-locate on)")
        if key_index and distributed_by is None:
            raise TableError("key_index needs distributed_by (the column to index)")
        schema, total, batches = open_source(source, self.settings.load_batch_rows)
        schema = storage_schema(schema)
        if distributed_by is not None:
            distributed_by = _key_column(schema, distributed_by, key_index)
        kind = "replicated" if replicated else "distributed"
        size, batches = arrow_size(source, total, batches) if not replicated else (None, batches)
        table = NewTable(
            name,
            schema.serialize().to_pybytes(),
            kind,
            distributed_by or "",
            colocate_with,
            bool(key_index),
            size,
            None if grants is None else tuple(grants),
        )
        planned = self.coordinator.begin_create(table).get()
        preview = Catalog.from_json(planned)
        spec = preview.table(name)
        try:
            rows = self._load(spec, preview, batches, total, progress)
            catalog = self.coordinator.commit_create(name, rows).get()
        except pa.ArrowException as error:  # rows that do not fit the schema
            self._abort(spec, preview)
            raise TableError(f"cannot load {name!r}: {error}") from None
        except BaseException:
            self._abort(spec, preview)
            raise
        for finished in [self.workers.get(n).finish_load(name) for n in preview.nodes]:
            finished.get()
        # each node is told the change (the table, its units), not the catalog whole
        self.coordinator.announce(list(catalog["nodes"])).get()
        return rows

    def _load(
        self,
        spec: TableSpec,
        preview: Catalog,
        batches: Iterator[pa.RecordBatch],
        total: int | None,
        progress: Progress | None,
    ) -> int:
        nodes = list(preview.nodes)
        primary = preview.primary
        units_by_node: dict[str, list[int]] = defaultdict(list)
        if spec.group is not None:
            for unit in preview.groups[spec.group].units:
                units_by_node[unit.node].append(unit.unit_id)
        targets = nodes if spec.kind == "replicated" else sorted(units_by_node)
        prepared = [
            self.workers.get(n).prepare(spec, units_by_node.get(n, []), n == primary)
            for n in targets
        ]
        for ready in prepared:
            ready.get()
        in_flight: list[Reply[int]] = []
        loaded = 0
        for batch in batches:
            table = pa.Table.from_batches([batch]).cast(spec.schema)
            if spec.kind == "replicated":
                in_flight += self._stage(spec.name, {n: {REPLICA: table} for n in nodes})
            else:
                by_node: dict[str, dict[int | str, pa.Table]] = defaultdict(dict)
                group = preview.group_of(spec.name)
                for unit_id, part in split_by_unit(table, spec, preview).items():
                    by_node[group.unit(unit_id).node][unit_id] = part
                in_flight += self._stage(spec.name, by_node)
            loaded += table.num_rows
            if len(in_flight) > MAX_IN_FLIGHT_LOADS * len(nodes):
                for reply in in_flight:
                    reply.get()
                in_flight = []
            if progress is not None:
                progress(loaded, total)
        for reply in in_flight:
            reply.get()
        committed = [self.workers.get(n).commit_load(spec.name) for n in targets]
        counts = [reply.get() for reply in committed]
        return loaded if spec.kind == "replicated" else sum(counts)

    def _stage(
        self, table: str, by_node: Mapping[str, Mapping[int | str, pa.Table]]
    ) -> list[Reply[int]]:
        """Hand each node its parts of a load batch: over its fast lane where it has one
        (Arrow IPC straight into the worker), else through the worker protocol (rows the
        same for every node, a replicated table's, shared once)."""
        sends = Counter(id(part) for parts in by_node.values() for part in parts.values())
        wire: dict[int, pa.Buffer] = {}
        shared: dict[int, SharedRows] = {}

        def encoded(part: pa.Table) -> pa.Buffer:
            if id(part) not in wire:
                wire[id(part)] = to_wire(part)
            return wire[id(part)]

        def through_workers(part: pa.Table) -> pa.Table | SharedRows:
            if sends[id(part)] == 1:
                return part
            if id(part) not in shared:
                shared[id(part)] = self.workers.share(part)
            return shared[id(part)]

        if self.closed.is_set():  # the lanes are closed, and the cluster is stopping
            raise ClosedError(f"loading {table}: the database was closed")
        replies: list[Reply[int]] = []
        for node, parts in by_node.items():
            address = self.lanes.address(node)
            if address is not None:
                wired = {unit: encoded(part) for unit, part in parts.items()}
                sent = self.lanes.pool.submit(self.lanes.lanes.stage, address, table, wired)
                replies.append(_LaneStage(self, node, sent))
            else:
                parts_sent = {unit: through_workers(part) for unit, part in parts.items()}
                replies.append(self.workers.get(node).stage(table, parts_sent))
        return replies

    def _abort(self, spec: TableSpec, preview: Catalog) -> None:
        for node in preview.nodes:
            try:
                self.workers.get(node).abort_load(spec.name).get()
            except Exception as error:  # the abort is best effort; files are removed below
                log.warning("abort of %s on %s failed: %s", spec.name, node, error)
        self.coordinator.abort_create(spec.name).get()


def _key_column(schema: pa.Schema, distributed_by: str, key_index: bool) -> str:
    """The source's column ``distributed_by`` names (as DuckDB matches names), checked to
    be one whose values hash to buckets (and, with ``key_index``, one DuckDB indexes)."""
    column = find_name(schema.names, distributed_by) or distributed_by
    if schema.get_field_index(column) < 0:
        raise UnknownColumnError(
            f"distributed_by names {column!r}, which is not a column of the "
            f"source (columns: {schema.names})"
        )
    try:
        key_family(schema.field(column).type)
    except TypeError as error:
        raise TableError(str(error)) from None
    if key_index and pa.types.is_duration(schema.field(column).type):
        raise TableError(
            f"key_index cannot index {column!r}: DuckDB keeps no index on a "
            "duration (INTERVAL) column"
        )
    return column


class _LaneStage:
    """A load's parts on their way over a fast lane (a :class:`Reply` of the rows staged)."""

    def __init__(self, loader: Loader, node: str, sent: Future[int]) -> None:
        self.loader = loader
        self.node = node
        self.sent = sent

    def get(self, timeout: float | None = None) -> int:
        try:
            return self.sent.result(timeout)
        except TimeoutError:
            raise WorkerTimeout(f"{self.node} staged no rows within {timeout} s") from None
        except LaneBroken as error:  # the rows may be staged or not: the load fails
            if self.loader.closed.is_set():  # the lanes were closed with the session
                raise ClosedError(f"{self.node}: the database was closed") from error
            self.loader.lanes.broken(self.node, error)
            self.loader.workers.get(self.node).ping().get()  # gone: said as the protocol says
            raise
