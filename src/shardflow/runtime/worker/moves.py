"""A worker's two halves of a live move, kept apart.

:class:`SourceSide` pins a snapshot of the moving shards, hands out its rows and the inserts
made since (hashing everything it hands out: the snapshot where it is stored, when it is
pinned; the inserts as they leave), fences writes and retires what moved.
:class:`TargetSide` builds the new shards beside the served ones from what the sources
hand out, keeps the checksum of what it stores, and serves them at the switch. The two
meet only through :class:`~shardflow.runtime.protocol.SourceLink` (worker to worker) and the
coordinator's calls; ``VERIFY`` compares their checksums (``control/migration.py``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.config import Settings
from shardflow.control.admission import CopyPacer
from shardflow.control.migration import (
    Checksum,
    MoveKind,
    MovePlan,
    SourceChecksums,
    verify_copy,
)
from shardflow.engine import DuckDBEngine
from shardflow.engine.duckdb_engine import NativeRows
from shardflow.errors import MoveCancelled, Moved
from shardflow.runtime.protocol import (
    ChangeSet,
    CopyResult,
    ExportPinned,
    FenceResult,
    FinalApplied,
    PinnedShard,
    ShardKey,
    SourceLink,
)
from shardflow.storage import Shard
from shardflow.storage.partition import buckets_for
from shardflow.storage.shard import CLAIMERS, BatchStream, Change

log = logging.getLogger(__name__)

CHUNK_ROWS = 128 * 1024
"""Rows per chunk of a move's snapshot: the unit of transfer and of bandwidth pacing."""

HASH_STEP_ROWS = 1 << 20
"""Rows of a plain move's local copy of a checkpoint (an object-store data directory) hashed
at a time for VERIFY (~50 ms of one lineitem unit's hashing here), paced between steps;
smaller steps cost more per row."""


PROMOTED_KEPT = 8
"""Promoted moves a target keeps to take back: more than the moves in flight at once."""


class ShardHost(Protocol):
    """What a move's halves need of the worker they run on (``worker/node.py``'s
    ``WorkerNode``): its shards and their readers, its engine, and its lock."""

    @property
    def node_id(self) -> str: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def engine(self) -> DuckDBEngine:
        """Holds the shards (native DuckDB tables)."""
        ...

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """Held while the served shards change."""
        ...

    @property
    def shards(self) -> dict[ShardKey, Shard]:
        """The shards served here."""
        ...

    @property
    def readers(self) -> Counter[ShardKey]:
        """Fragments reading each shard now."""
        ...

    @property
    def catalog(self) -> Catalog:
        """The catalog served."""
        ...

    def new_shard(self, spec: TableSpec, name: str, *, writer: bool) -> Shard:
        """An empty shard of ``spec`` in the engine, its files under ``name``."""
        ...

    def release(self, shard: Shard) -> None:
        """Stop serving ``shard`` and free its rows."""
        ...

    def release_when_read(self, key: ShardKey, shard: Shard, *, files: bool = False) -> None:
        """Release ``shard`` now, or once the fragments reading it finish; with ``files``,
        its files go too. Holds ``lock``."""
        ...

    def foreground_slowdown(self) -> float:
        """How much slower than usual this node's own work runs now (1.0: as usual)."""
        ...

    def serve(self, catalog: Catalog) -> int:
        """Serve what ``catalog`` assigns this node."""
        ...

    def prewarm(self, shards: Iterable[Shard]) -> None:
        """Keep the frames of shards about to be served, where the node keeps frames."""
        ...


def _checksum(node: ShardHost, rows: pa.Table) -> Checksum:
    if rows.num_rows == 0:
        return Checksum()
    count, digest = node.engine.checksum_rows(rows)
    return Checksum(count, digest)


def _physical(shard: Shard) -> NativeRows:
    assert isinstance(shard.data, NativeRows), "a worker's shards are native DuckDB tables"
    return shard.data


# -- the source half ---------------------------------------------------------------------
@dataclass
class Export:
    """This node as a source of one move: the shards it exports, pinned at a snapshot, and
    the checksum of everything it has handed out (snapshot and changes since)."""

    plan: MovePlan
    shards: dict[ShardKey, Shard]
    streams: dict[ShardKey, BatchStream] = field(default_factory=dict)
    """The pinned snapshot of each shard, handed out a chunk at a time."""
    handed_out: dict[str, Checksum] = field(default_factory=dict)
    counted: dict[ShardKey, int] = field(default_factory=dict)
    """Per shard, the LSN up to which changes were handed out (and hashed)."""
    prehashed: set[ShardKey] = field(default_factory=set)
    """Shards whose whole snapshot was hashed where stored when pinned: their chunks leave
    without being hashed again."""
    fenced_at: float | None = None
    """When the fence began to hold writers here (``time.monotonic``)."""


@dataclass(frozen=True)
class Retired:
    kind: MoveKind
    shards: Mapping[ShardKey, Shard]


class SourceSide:
    """This node as the source of moves."""

    def __init__(self, node: ShardHost) -> None:
        self.node = node
        self.exports: dict[str, Export] = {}
        self.retired: dict[str, Retired] = {}

    def pin(self, plan: MovePlan) -> ExportPinned:
        """Pin a snapshot of every shard of the plan's source units on this node; the rows
        follow through :meth:`chunk`, the inserts made from now on through :meth:`changes`."""
        node = self.node
        units = {s.unit_id for s in plan.sources if s.node == node.node_id}
        with node.lock:
            shards = {k: v for k, v in node.shards.items() if k[1] in units}
            missing = {u for u in units if not any(k[1] == u for k in shards)}
            if missing:
                raise Moved(f"units {sorted(missing)}", node.catalog.epoch)
            export = Export(plan, shards, handed_out={table: Checksum() for table, _ in shards})
            self.exports[plan.move_id] = export
        pinned = {}
        for key, shard in shards.items():
            lsn, applied, stream = shard.begin_streaming_export(CHUNK_ROWS, plan.move_id)
            export.streams[key] = stream
            export.counted[key] = lsn
            pinned[key] = PinnedShard(lsn, applied)
        for key, stream in export.streams.items():  # writers go on meanwhile
            snapshot = stream.checksum()
            if snapshot is not None:
                self._count_out(export, key[0], Checksum(*snapshot))
                export.prehashed.add(key)
        return ExportPinned(node.node_id, pinned)

    def chunk(self, move_id: str, key: ShardKey) -> pa.Table | None:
        """The next chunk of a shard's pinned snapshot (None once all were handed out),
        added to the checksum of what was handed out as it leaves (unless the whole
        snapshot was hashed when pinned)."""
        export = self.exports[move_id]
        chunk = export.streams[key].next()
        if chunk is not None and key not in export.prehashed:
            self._hand_out(export, key[0], chunk)
        return chunk

    def changes(self, move_id: str, since: Mapping[ShardKey, int]) -> ChangeSet:
        """The inserts each shard took in after LSN ``since[shard]`` (after its snapshot
        where not given); those not handed out before count into the checksum now. A
        target that holds more than it was sent (``since`` past what was handed out: it
        opened a checkpoint written after the pin) holds the inserts in between too: they
        count as well (they were left out, and VERIFY failed a sound move)."""
        export = self.exports[move_id]
        found: dict[ShardKey, tuple[Change, ...]] = {}
        for key, shard in export.shards.items():
            after = since[key] if key in since else export.counted[key]
            counted = export.counted[key]
            sent: list[Change] = []
            fresh: list[pa.Table] = []
            for change in shard.changes_since(min(after, counted), move_id):
                if change.lsn > counted:
                    fresh.append(change.rows)
                    counted = change.lsn
                if change.lsn > after:
                    sent.append(change)
            if fresh:  # hashed together: one query, not one per insert (a heavy ingest
                # outran the catch-up with a query per 50-row insert)
                self._hand_out(export, key[0], pa.concat_tables(fresh))
            export.counted[key] = counted
            found[key] = tuple(sent)
        return ChangeSet(self.node.node_id, found)

    def fence(self, move_id: str) -> FenceResult:
        """Hold new writes to the exported shards (they wait, they do not fail) and hand
        out, in one answer, the changes not handed out yet and the final checksums, with
        the rows the shards hold under the fence. One call, so that writers wait as briefly
        as possible."""
        export = self.exports[move_id]
        if export.fenced_at is None:  # a fence asked again holds on from the first
            export.fenced_at = time.monotonic()
        for shard in export.shards.values():
            shard.fence()
        last = self.changes(move_id, dict(export.counted))
        held: Counter[str] = Counter()
        for (table, _), shard in export.shards.items():
            held[table] += shard.rows
        sums = SourceChecksums(self.node.node_id, dict(export.handed_out), dict(held))
        return FenceResult(last, sums)

    def abort(self, move_id: str) -> None:
        """The move rolled back: serve writes again, as if nothing happened."""
        export = self.exports.pop(move_id, None)
        if export is None:
            return
        for stream in export.streams.values():
            stream.close()
        for shard in export.shards.values():
            shard.end_export(move_id)
            shard.claim_again(self.node.node_id)  # its target may have claimed it already
            shard.unfence()

    def retire(self, move_id: str) -> float | None:
        """The switch happened: stop serving the moved shards (fragments and inserts for
        them are told ``Moved``), keep them until the readers still on them finish.
        Answers how long the fence held writers here (seconds; None where this node
        holds no such export: retired already, or a roll-back came first)."""
        export = self.exports.pop(move_id, None)
        if export is None:
            return None
        for stream in export.streams.values():  # a plain move's is never read: its pinned
            stream.close()  # transaction ends here, not whenever the stream is collected
        node = self.node
        with node.lock:
            for key, shard in export.shards.items():
                shard.retire()
                if node.shards.get(key) is shard:
                    del node.shards[key]
            self.retired[move_id] = Retired(export.plan.kind, dict(export.shards))
        return None if export.fenced_at is None else time.monotonic() - export.fenced_at

    def drop_retired(self, move_id: str) -> bool:
        """Drop the retired shards (and their files, unless a move's: the new owner writes
        them) now, or once the fragments still reading them finish: the move's cleanup
        never waits for a long query (it waited up to a minute, and then kept the shards
        for good)."""
        retired = self.retired.pop(move_id, None)
        if retired is None:
            return True
        with self.node.lock:
            for key, shard in retired.shards.items():
                self.node.release_when_read(key, shard, files=retired.kind != "move")
        return True

    def _hand_out(self, export: Export, table: str, rows: pa.Table) -> None:
        self._count_out(export, table, _checksum(self.node, rows))

    def _count_out(self, export: Export, table: str, sums: Checksum) -> None:
        with self.node.lock:
            export.handed_out[table] = export.handed_out[table] + sums


# -- the target half ---------------------------------------------------------------------
@dataclass
class Import:
    """This node as the target of one move: new shards built beside the served ones."""

    plan: MovePlan
    units: list[tuple[int, int, int]]
    """(unit_id, lo, hi) of the targets on this node."""
    shards: dict[ShardKey, Shard]
    applied: dict[ShardKey, int] = field(default_factory=dict)
    """Per source shard, the LSN applied so far."""
    stored: dict[str, Checksum] = field(default_factory=dict)
    """Per table, the checksum of what the new shards hold: the snapshot as stored (read
    back from the shards once the copy is committed), plus every change applied since."""
    compacted: bool = False
    """Whether the copy's rows were compressed (at the first catch-up)."""
    release_compaction: Callable[[], None] = lambda: None
    """Lets the engine's compactor at the new shards again (held back while they are built)."""

    @property
    def shares_files(self) -> bool:
        """A plain move keeps the unit's id and files: the source logged every insert the
        copy replays, so the copy writes nothing until it takes over at the switch."""
        return self.plan.kind == "move"


class TargetSide:
    """This node as the target of moves."""

    def __init__(self, node: ShardHost) -> None:
        CLAIMERS.start()  # a move's promotion hands its claims over (no thread starts then)
        self.node = node
        self.imports: dict[str, Import] = {}
        self.cancelled: set[str] = set()
        """Moves an operator cancelled (until their roll-back here)."""
        self.promoted: OrderedDict[str, Import] = OrderedDict()
        """The last moves promoted here: served, but maybe not switched yet (the switch
        may fail, or the coordinator restart): an abort still takes them back."""

    def building(self, table: str, unit_id: int) -> bool:
        """Whether a move in progress builds this shard here (it is served at the switch)."""
        return any((table, unit_id) in move.shards for move in self.imports.values())

    def copy_snapshot(
        self, plan: MovePlan, link: Callable[[str], SourceLink], bandwidth_bytes_s: float
    ) -> CopyResult:
        """Copy the sources' pinned snapshots into new shards here, chunk by chunk, paced by
        how much this node's own work slows down (``control/admission.py``), at most
        ``bandwidth_bytes_s`` (0: no cap), and commit them; then read back the checksum of
        what was stored. ``link`` reaches the source on a node."""
        move = self._begin(plan)
        self._hold_for_test(plan.move_id)
        pacer = CopyPacer.capped(bandwidth_bytes_s)
        if move.shares_files:
            return self._open_files(move, link, pacer)
        rows = size = 0
        for node in _source_nodes(plan):
            source = link(node)
            pinned = source.pin(plan)
            for key, pin in pinned.shards.items():
                last = time.monotonic()
                for chunk in source.chunks(plan.move_id, key):
                    if plan.move_id in self.cancelled:
                        raise MoveCancelled(f"move {plan.move_id} was cancelled during its copy")
                    rows += self._stage(move, key, chunk)
                    size += chunk.nbytes
                    slowdown = self.node.foreground_slowdown()
                    wait = pacer.after_chunk(chunk.nbytes, time.monotonic() - last, slowdown)
                    if wait > 0:
                        time.sleep(wait)
                    last = time.monotonic()
                self._snapshot_done(move, key, pin)
        if pacer.waited:
            log.info(
                "move %s: the copy gave way to the foreground for %.1f s",
                plan.move_id,
                pacer.waited,
            )
        for shard in move.shards.values():
            shard.commit_load()
        self._inject_test_fault(move)
        move.stored = self._stored_checksums(move)
        return CopyResult(rows, size)

    def _open_files(
        self, move: Import, link: Callable[[str], SourceLink], pacer: CopyPacer
    ) -> CopyResult:
        """A plain move ships storage, not rows: the new shard opens the unit's newest
        checkpoint file (where it lies in the shared data directory) and replays the log
        after it up to the source's pinned LSN; what the source takes in after that comes
        through catch-up, as with a copy. The source only pins (its checksum: the file's,
        kept in its record, and its tail's); nothing is read out of it, decoded or
        compressed again. A file that is not what its record says fails the move. VERIFY
        hashes the rows replayed from the log; the file read where it lies is the one
        the source's checksum names, and its record's sums stand for it (DuckDB checks
        each block as it reads it). A local copy of it (an object-store data directory)
        is hashed, paced as a copy is, by how much this node's own work slows down."""
        rows = size = 0
        for node in _source_nodes(move.plan):
            pinned = link(node).pin(move.plan)
            for key, pin in pinned.shards.items():
                if move.plan.move_id in self.cancelled:
                    raise MoveCancelled(f"move {move.plan.move_id} was cancelled during its copy")
                shard = move.shards[key]
                shard.recover(upto=pin.lsn)
                shard.adopt(pin.applied)
                move.applied[key] = shard.lsn
                rows += shard.rows
                size += shard.nbytes
        self._inject_test_fault(move)

        def after_step(nbytes: int, seconds: float) -> None:
            if move.plan.move_id in self.cancelled:
                raise MoveCancelled(f"move {move.plan.move_id} was cancelled during its copy")
            wait = pacer.after_chunk(nbytes, seconds, self.node.foreground_slowdown())
            if wait > 0:
                time.sleep(wait)

        move.stored = self._stored_checksums(
            move, lambda rows: rows.checksum_in_steps(HASH_STEP_ROWS, after_step)
        )
        if pacer.waited:
            log.info("move %s: its hash gave way for %.1f s", move.plan.move_id, pacer.waited)
        return CopyResult(rows, size)

    def _hold_for_test(self, move_id: str) -> None:
        """``Settings.test_hold_copy_s`` (tests only; 0, off, by default): wait before the
        copy, so that a test sees the move in flight; a cancel ends the wait."""
        until = time.monotonic() + self.node.settings.test_hold_copy_s
        while time.monotonic() < until:
            if move_id in self.cancelled:
                raise MoveCancelled(f"move {move_id} was cancelled during its copy")
            time.sleep(0.05)

    def cancel(self, move_id: str) -> None:
        """Stop the copy of a move an operator cancelled (its roll-back follows), also one
        whose copy has not begun here yet."""
        with self.node.lock:
            self.cancelled.add(move_id)

    def catch_up(self, move_id: str, link: Callable[[str], SourceLink]) -> int:
        """Apply what the sources took in since the last pull; returns those rows."""
        move = self.imports[move_id]
        if move_id in self.cancelled:
            raise MoveCancelled(f"move {move_id} was cancelled")
        if not move.compacted:
            # the copy is compressed here, where only the move waits for it (the sources
            # take writes meanwhile; this round carries them): left to the compactor, it
            # would hold the fence's appends, or the shard's first inserts after the switch
            for shard in move.shards.values():
                _physical(shard).compact()
            move.compacted = True
            self._prewarm(move)
        since = dict(move.applied)
        nodes = _source_nodes(move.plan)
        replies = [link(node).changes(move_id, since) for node in nodes]  # all at once
        return sum(self._apply(move, reply.get()) for reply in replies)

    def _prewarm(self, move: Import) -> None:
        """Build the new shards' frames on the device now, while the sources still serve:
        the first query after the switch finds them (only their last appends are added
        then). A move never fails for it."""
        try:
            self.node.prewarm(move.shards.values())
        except Exception as error:
            log.warning("move %s: frames not built ahead: %s", move.plan.move_id, error)

    def finish_import(self, move_id: str, link: Callable[[str], SourceLink]) -> FinalApplied:
        """Fence every source (all at once, worker to worker: the coordinator is not
        between a source's fence and this node's apply, a round trip less while writers
        wait), then :meth:`apply_final` what they handed out; the answer carries what each
        said it handed out, for the coordinator's VERIFY."""
        move = self.imports[move_id]
        replies = [link(node).fence(move_id) for node in _source_nodes(move.plan)]
        fenced = [reply.get() for reply in replies]
        final = self.apply_final(move_id, fenced)
        return replace(final, handed_out=tuple(f.sums for f in fenced))

    def apply_final(self, move_id: str, fenced: Sequence[FenceResult]) -> FinalApplied:
        """Apply the last changes the fenced sources handed out; answer the rows applied and
        the checksums of what the new shards hold now. Where those equal what the sources
        handed out (VERIFY's own check, which the coordinator makes again), the new shards
        are served from here on: the switch that follows only routes to them."""
        move = self.imports[move_id]
        rows = sum(self._apply(move, source.changes) for source in fenced)
        stored = dict(move.stored)
        verified = verify_copy(tuple(source.sums for source in fenced), stored)
        if verified.ok:
            self.promote(move_id)
        return FinalApplied(rows, stored, verified.ok)

    def promote(self, move_id: str) -> None:
        """Serve the new shards (the routing switch follows)."""
        node = self.node
        with node.lock:
            move = self.imports.pop(move_id, None)
            if move is None:  # promoted already: the switch is being retried
                return
            self.promoted[move_id] = move
            while len(self.promoted) > PROMOTED_KEPT:
                self.promoted.popitem(last=False)
            move.release_compaction()
            for key, shard in move.shards.items():
                if move.shares_files:  # it takes over the source's log: the fenced source
                    shard.claim_soon(node.node_id)  # writes no more (first writes wait)
                shard.writer = True  # from the switch on, this copy logs the inserts
                node.shards[key] = shard

    def abort(self, move_id: str) -> None:
        """The move rolled back: drop the new shards, served already or not."""
        node = self.node
        with node.lock:
            self.cancelled.discard(move_id)
            move = self.imports.pop(move_id, None) or self.promoted.pop(move_id, None)
            if move is None:
                return
            for key, shard in move.shards.items():
                if node.shards.get(key) is shard:  # promoted, not switched: served no longer
                    del node.shards[key]
        move.release_compaction()
        for shard in move.shards.values():
            try:  # a claim under way ends before the source claims the shard again
                shard.await_claim()
            except Exception as error:
                log.info("move %s: the claim taken back failed: %s", move_id, error)
            shard.abandon_load()
            self.node.release(shard)
            if not move.shares_files:  # the source's files are the shard's files
                shard.store.destroy()
        # a failover during the move may have given this node the very unit it was copying
        # (its source died): catalog syncs left it to the copy, so serve it from its files now
        self.node.serve(self.node.catalog)

    # -- steps ----------------------------------------------------------------------------
    def _begin(self, plan: MovePlan) -> Import:
        node = self.node
        mine = [(t.unit_id, t.lo, t.hi) for t in plan.targets if t.node == node.node_id]
        shards: dict[ShardKey, Shard] = {}
        writes = plan.kind != "move"
        for table in node.catalog.group_tables(plan.group):
            spec = node.catalog.table(table)
            for unit_id, _, _ in mine:
                shard = node.new_shard(spec, str(unit_id), writer=writes)
                if writes:  # a split's or a merge's new unit: files of its own
                    shard.claim(node.node_id, node.catalog.epoch)
                shards[(table, unit_id)] = shard
        # the compactor leaves the new shards alone while they are built: the copy
        # compacts them itself once its rows are in, and catch-up and fence never wait
        held = node.engine.compactor.hold(_physical(shard).physical for shard in shards.values())
        move = Import(plan, mine, shards, release_compaction=held)
        with node.lock:
            self.imports[plan.move_id] = move
        return move

    def _stage(self, move: Import, source: ShardKey, rows: pa.Table) -> int:
        """Stage rows of a source shard's snapshot into the target shards they belong to."""
        table, _ = source
        staged = 0
        for unit_id, part, _ in self._route(move, source, rows, None):
            move.shards[(table, unit_id)].stage(part)
            staged += part.num_rows
        return staged

    def _snapshot_done(self, move: Import, source: ShardKey, pinned: PinnedShard) -> None:
        move.applied[source] = pinned.lsn
        for (table, _), shard in move.shards.items():
            if table == source[0]:
                shard.adopt(pinned.applied)
                if move.shares_files:
                    shard.lsn = pinned.lsn  # it continues the source's log

    def _stored_checksums(
        self,
        move: Import,
        hashed: Callable[[NativeRows], tuple[int, int]] = NativeRows.checksum,
    ) -> dict[str, Checksum]:
        """Per table, rows and hash sum of what the new shards hold, read from the shards
        (by ``hashed``: at once, or a step at a time)."""
        stored: dict[str, Checksum] = {table: Checksum() for table, _ in move.shards}
        for (table, _), shard in move.shards.items():
            stored[table] = stored[table] + Checksum(*hashed(_physical(shard)))
        return stored

    def _apply(self, move: Import, changes: ChangeSet) -> int:
        """Apply the inserts a source took in after what was applied (durably, with their
        batch ids); returns the rows applied."""
        applied = 0
        for source, entries in changes.changes.items():
            table = source[0]
            done = move.applied.get(source, 0)
            todo = [c for c in sorted(entries, key=lambda c: c.lsn) if c.lsn > done]
            if not todo:
                continue
            by_unit: dict[int, list[tuple[pa.Table, str, np.ndarray | None, int | None]]] = {}
            for change in todo:
                # a plain move's copy continues the source's log: the same LSNs
                lsn = change.lsn if move.shares_files else None
                for unit_id, part, buckets in self._route(
                    move, source, change.rows, change.buckets
                ):
                    by_unit.setdefault(unit_id, []).append((part, change.batch_id, buckets, lsn))
            for unit_id, group in by_unit.items():  # one group commit (a directory sync)
                # and one hash per new shard and round: the fence's last round waits on it
                results = move.shards[(table, unit_id)].append_many(group)
                applied += sum(result.rows for result in results)
                new = [r.appended for r in results if r.appended is not None]
                if new:
                    move.stored[table] = move.stored[table] + _checksum(
                        self.node, pa.concat_tables(new)
                    )
            move.applied[source] = todo[-1].lsn
        return applied

    def _route(
        self, move: Import, source: ShardKey, rows: pa.Table, buckets: np.ndarray | None
    ) -> list[tuple[int, pa.Table, np.ndarray | None]]:
        """Which of this node's target units each row belongs to, by bucket."""
        if len(move.units) == 1 and len(move.plan.targets) == 1:
            return [(move.units[0][0], rows, buckets)] if rows.num_rows else []
        if buckets is None:
            spec = self.node.catalog.table(source[0])
            if spec.key:
                buckets = buckets_for(rows, spec, self.node.catalog.n_buckets)
            else:  # no key and no recorded buckets: any split of the rows is right
                span = next(s for s in move.plan.sources if s.unit_id == source[1])
                width = span.hi - span.lo
                buckets = (span.lo + np.arange(rows.num_rows) % width).astype(np.int32)
        routed: list[tuple[int, pa.Table, np.ndarray | None]] = []
        for unit_id, lo, hi in move.units:
            mask = (buckets >= lo) & (buckets < hi)
            if mask.any():
                routed.append((unit_id, rows.filter(pa.array(mask)), buckets[mask]))
        return routed

    # -- the test-only fault hook ---------------------------------------------------------
    def _inject_test_fault(self, move: Import) -> None:
        """``Settings.test_fault_move_copy`` (tests only; off by default): once the copy is
        stored, remove one row from it ("drop_row") or change one value ("change_value"),
        so that the target really holds something else than the sources handed out."""
        fault = self.node.settings.test_fault_move_copy
        if not fault:
            return
        for (table, unit_id), shard in sorted(move.shards.items()):
            if shard.rows == 0:
                continue
            _physical(shard).corrupt_for_test(fault)
            log.warning(
                "test fault %s injected into the copy of %s#%d on %s (move %s)",
                fault,
                table,
                unit_id,
                self.node.node_id,
                move.plan.move_id,
            )
            return


def _source_nodes(plan: MovePlan) -> list[str]:
    return sorted({s.node for s in plan.sources})
