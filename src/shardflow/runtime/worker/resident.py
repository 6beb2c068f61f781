"""The shards a worker keeps in its engine's own memory: on a GPU worker the device's, so
that a fragment reads its shards without a copy out of DuckDB and onto the device; on a CPU
worker running Polars the same code keeps Polars frames (the twin that ``make test`` runs).

A shard's frame is built once from its rows and kept current by its appends (their rows
added, never a rebuild), and is never older than the shard it is read for: each read
compares the frame's log sequence number with the shard's and catches up first. A shard
built again (a move's target, a split's or merge's halves, a failover's rebuild) is another
shard, with a frame of its own; one released (moved away, dropped) forgets its frame. The
least recently used frames go beyond a byte budget. DuckDB and the data directory stay the
source of truth: a frame is only ever a copy of what the shard holds.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import pyarrow as pa

from shardflow.storage import Shard

if TYPE_CHECKING:  # the engine (and SQLGlot with it) is imported where it runs, not here
    from shardflow.engine.polars_engine import Resident

log = logging.getLogger(__name__)
BUILD_BATCH_ROWS = 256_000
"""Rows read out of DuckDB at a time when a frame is built."""


class FrameKind(Protocol):
    """How an engine keeps rows in its own memory (``engine/polars_engine.PolarsFrames``)."""

    name: str

    def build(self, batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> Resident: ...
    def extend(self, kept: Resident, tables: Sequence[pa.Table]) -> Resident: ...
    def nbytes(self, kept: Resident) -> int: ...


@runtime_checkable
class KeepsFrames(Protocol):
    """An engine that runs fragments over kept frames (``PolarsEngine``)."""

    frames: FrameKind

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table] | None = None,
        views: Mapping[str, str] | None = None,
        resident: Mapping[str, Sequence[Resident]] | None = None,
    ) -> pa.Table: ...


@dataclass(frozen=True)
class _Kept:
    frame: Resident
    lsn: int
    """The shard's log sequence number the frame holds the rows of."""
    nbytes: int


@dataclass(frozen=True)
class ResidentStats:
    """What a worker keeps, and how often a fragment found a shard kept."""

    budget_bytes: int
    bytes: int
    shards: int
    hits: int
    """Reads that found the shard's frame current."""
    extended: int
    """Reads that added the shard's new appends to its frame first."""
    misses: int
    """Reads that built the frame (first read, evicted, or too many appends since)."""
    evictions: int

    @property
    def hit_rate(self) -> float:
        reads = self.hits + self.extended + self.misses
        return (self.hits + self.extended) / reads if reads else 0.0


class ResidentShards:
    """A worker's kept shard frames (see the module's docstring)."""

    def __init__(self, kind: FrameKind, budget_bytes: int, fault: str = "") -> None:
        self.kind = kind
        self.budget_bytes = budget_bytes
        self.fault = fault
        """``test_fault_resident`` (tests only): "skip_append" catches up without the rows."""
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = self._extended = self._misses = self._evictions = 0
        self._too_big: set[int] = set()

    def frame(self, shard: Shard) -> Resident:
        """The shard's rows as a frame of the engine, current to the shard's LSN now."""
        with self._lock:
            kept = self._kept.get(shard.ident)
            if kept is not None:
                self._kept.move_to_end(shard.ident)
        if kept is not None:
            lsn, added = shard.rows_since(kept.lsn)
            if added is not None and not added:
                with self._lock:
                    self._hits += 1
                return kept.frame
            if added is not None:  # the appends since: added to the frame, not rebuilt
                frame = (
                    kept.frame
                    if self.fault == "skip_append"
                    else self.kind.extend(kept.frame, added)
                )
                self._keep(shard, _Kept(frame, lsn, self.kind.nbytes(frame)))
                with self._lock:
                    self._extended += 1
                return frame
        shard.keeps_recent = True  # from now on its appends can be added to the frame
        lsn, stream = shard.pinned(BUILD_BATCH_ROWS)
        try:
            batches: list[pa.RecordBatch] = []
            while (chunk := stream.next()) is not None:
                batches += chunk.to_batches()
        finally:
            stream.close()
        frame = self.kind.build(batches, shard.schema)
        self._keep(shard, _Kept(frame, lsn, self.kind.nbytes(frame)))
        with self._lock:
            self._misses += 1
        return frame

    def prewarm(self, shards: Iterable[Shard]) -> None:
        """Build the frames of shards about to be served (a move's target, before its
        switch: the first query after the move finds them)."""
        for shard in shards:
            self.frame(shard)

    def forget(self, shard: Shard) -> None:
        """The shard is no longer served here: its frame goes."""
        with self._lock:
            kept = self._kept.pop(shard.ident, None)
            if kept is not None:
                self._bytes -= kept.nbytes
            self._too_big.discard(shard.ident)
        shard.keeps_recent = False

    def stats(self) -> ResidentStats:
        with self._lock:
            return ResidentStats(
                self.budget_bytes,
                self._bytes,
                len(self._kept),
                self._hits,
                self._extended,
                self._misses,
                self._evictions,
            )

    def _keep(self, shard: Shard, kept: _Kept) -> None:
        with self._lock:
            if shard.retired:  # released meanwhile: keep nothing of it
                return
            if kept.nbytes > self.budget_bytes:
                if shard.ident not in self._too_big:
                    self._too_big.add(shard.ident)
                    log.warning(
                        "%s: its %d bytes exceed the device cache (device_cache_mb, %d bytes): "
                        "every read builds it again; split it, or give the cache more",
                        shard.store.folder,
                        kept.nbytes,
                        self.budget_bytes,
                    )
                return
            old = self._kept.get(shard.ident)
            if old is not None and old.lsn > kept.lsn:  # a newer one was kept meanwhile
                return
            if old is not None:
                self._bytes -= old.nbytes
            self._kept[shard.ident] = kept
            self._kept.move_to_end(shard.ident)
            self._bytes += kept.nbytes
            while self._bytes > self.budget_bytes and len(self._kept) > 1:
                _, evicted = self._kept.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1
                if self._evictions == 1:
                    log.warning(
                        "this worker serves more shards than its device cache holds "
                        "(device_cache_mb, %d bytes): the least recently read are dropped and "
                        "built again when read; its nodes() device_cache_hit_rate shows the cost",
                        self.budget_bytes,
                    )
