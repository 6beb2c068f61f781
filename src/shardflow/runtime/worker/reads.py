"""Reads bound to shards: a fragment is bound to the shards it reads as it begins
(:meth:`BoundReads.bind`), and a shard no longer served here (moved away, split, merged,
dropped) is released only once the reads bound to it ended. A part of
:class:`~shardflow.runtime.worker.node.WorkerNode` (a mixin: the node's shards, lock and
views are its own)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from shardflow.catalog import TableSpec
from shardflow.runtime.protocol import ShardKey
from shardflow.storage import Shard


@dataclass(frozen=True)
class BoundPart:
    """A fragment's binding: the views naming its shards, the shards by table, the keys it
    reads (counted as readers until it ends), and their rows and bytes."""

    views: dict[str, str]
    bound: dict[str, list[Shard]]
    reading: list[ShardKey]
    rows: int
    bytes: int


class BoundReads:
    """Binding reads to shards and releasing shards once unread (see the module)."""

    lock: threading.RLock
    shards: dict[ShardKey, Shard]
    readers: Counter[ShardKey]
    _running: int
    _releasing: list[tuple[ShardKey, Shard, bool]]
    _releasing_replicas: list[Shard]
    check_commits: Callable[[Mapping[str, int], int], dict[str, TableSpec]]
    """``RowChanges.check_commits`` (annotated only: a method here would hide it)."""

    # the node's own (``WorkerNode``)
    def release(self, shard: Shard) -> None:
        raise NotImplementedError

    def _check_member(self) -> None:
        raise NotImplementedError

    def views_for(self, bindings: Mapping[str, list[int]], epoch: int) -> dict[str, str]:
        raise NotImplementedError

    def release_when_read(self, key: ShardKey, shard: Shard, *, files: bool = False) -> None:
        """Release a shard no longer served here: now, or when the fragments still reading
        it finish (they were bound to it before the catalog changed or a move retired it);
        with ``files``, its files go too (a unit split or merged away). Holds ``lock``."""
        if self.readers[key] > 0:
            shard.retire()
            self._releasing.append((key, shard, files))
        else:
            self._release_with(shard, files)

    def _release_with(self, shard: Shard, files: bool) -> None:
        self.release(shard)
        if files:
            shard.store.destroy()

    def _release_unread(self) -> None:
        """Release the shards :meth:`release_when_read` kept for readers now gone."""
        if self._releasing_replicas and not self._running:
            for replica in self._releasing_replicas:
                self.release(replica)
            self._releasing_replicas = []
        waiting = []
        for key, shard, files in self._releasing:
            if self.readers[key] > 0:
                waiting.append((key, shard, files))
            else:
                self._release_with(shard, files)
        self._releasing = waiting

    def _release_replica_when_idle(self, shard: Shard) -> None:
        """Release a replicated table's copy no longer served here: now, or once no
        fragment runs here (they read it through its standing view, bound as they began).
        Holds ``lock``."""
        if self._running > 0:
            shard.retire()
            self._releasing_replicas.append(shard)
        else:
            self.release(shard)

    def bind(
        self, bindings: Mapping[str, list[int]], epoch: int, commits: Mapping[str, int]
    ) -> BoundPart:
        """Bind a fragment to the shards of ``bindings`` as of ``epoch`` (refused, as a
        fragment is, where they moved or the tables changed since ``commits``): they stay
        readable here, a move or a split notwithstanding, until the fragment ran over them
        or :meth:`unbind` let them go. Counted as a running fragment meanwhile."""
        self._check_member()
        with self.lock:
            self.check_commits(commits, epoch)
            views = self.views_for(bindings, epoch)
            reading = [(t, u) for t, units in bindings.items() for u in units]
            bound = {t: [self.shards[(t, u)] for u in sorted(us)] for t, us in bindings.items()}
            self.readers.update(reading)
            self._running += 1
            rows = sum(self.shards[key].rows for key in reading)
            nbytes = sum(self.shards[key].nbytes for key in reading)
        return BoundPart(views, bound, reading, rows, nbytes)

    def unbind(self, part: BoundPart) -> None:
        """Let go of a part bound by :meth:`bind` that will not run."""
        with self.lock:
            self._unbind(part)

    def _unbind(self, part: BoundPart) -> None:
        self.readers.subtract(part.reading)
        self._running -= 1
        if self._releasing or self._releasing_replicas:
            self._release_unread()
