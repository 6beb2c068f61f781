"""A query's fragments through Ray's object store (the client's one use of Ray): a
fragment's result stays on its worker, in the store, until a later stage's workers read it
there or the client needs its rows; an input the client holds is put in the store once a
query, however many workers read it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import ray
from ray import ObjectRef

from shardflow.errors import Error
from shardflow.runtime.fastlane import from_wire
from shardflow.runtime.protocol import FragmentStats
from shardflow.runtime.query.executor import Concatenated, FragmentResult, Output
from shardflow.runtime.query.fragments import ABANDON_WAIT_S
from shardflow.runtime.ray.handles import RayWorkers
from shardflow.runtime.ray.replies import RayReply


@dataclass
class RayOutput:
    """A fragment result left in Ray's object store until someone needs its rows."""

    ref: ObjectRef[pa.Buffer]
    _table: pa.Table | None = None
    transfer_seconds: float = 0.0

    def table(self) -> pa.Table:
        if self._table is None:
            started = time.perf_counter()
            self._table = from_wire(RayReply(self.ref, "a fragment result").get())
            self.transfer_seconds = time.perf_counter() - started
        return self._table

    @property
    def held(self) -> bool:
        return self._table is not None


class RayCalls:
    """A query's fragments as actor calls whose results stay in the object store."""

    def __init__(self, workers: RayWorkers) -> None:
        self.workers = workers
        self._puts: dict[int, ObjectRef[pa.Table]] = {}

    def submit(
        self,
        node: str,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        inputs: Mapping[str, Output],
        profile: bool,
        commits: Mapping[str, int] | None = None,
    ) -> RayPending:
        worker = self.workers.get(node)
        names, refs = self._refs(inputs)
        submitted = time.time()
        table_ref, stats_ref = worker.submit(sql, bindings, epoch, names, profile, refs, commits)
        return RayPending(node, table_ref, RayReply(stats_ref, f"worker {node}"), submitted)

    def _refs(self, inputs: Mapping[str, Output]) -> tuple[list[str], list[ObjectRef[pa.Table]]]:
        """Every input as object references, a name repeated once per part: results still
        on the workers travel worker to worker; client-side tables are put once per query."""
        names: list[str] = []
        refs: list[ObjectRef[pa.Table]] = []
        for name, value in inputs.items():
            for part in parts(value):
                if isinstance(part, RayOutput):
                    ref = part.ref
                else:
                    key = id(part)
                    if key not in self._puts:
                        self._puts[key] = ray.put(part.table())
                    ref = self._puts[key]
                names.append(name)
                refs.append(ref)
        return names, refs


class RayPending:
    """A fragment whose measurements come back while its result stays in the store."""

    def __init__(
        self,
        node: str,
        table_ref: ObjectRef[pa.Buffer],
        stats: RayReply[FragmentStats],
        submitted: float,
    ) -> None:
        self.node = node
        self.table_ref = table_ref
        self.stats = stats
        self.submitted = submitted

    def result(self) -> FragmentResult:
        try:
            stats = self.stats.get()
        except Error:  # retried, or the query's own error: its result is never read
            _discard(self.table_ref)
            raise
        output = RayOutput(self.table_ref)
        return FragmentResult(
            output, self.node, stats.seconds, stats.rows_out, stats, self.submitted, via="ray"
        )

    def abandon(self) -> None:
        try:
            self.stats.get(ABANDON_WAIT_S)
        except Error:
            pass
        _discard(self.table_ref)


def parts(value: Output) -> list[Output]:
    """The fragment results an output is made of, where it was not fetched whole yet."""
    if isinstance(value, Concatenated) and value._table is None:
        return [p for part in value.parts for p in parts(part)]
    return [value]


def _discard(ref: ObjectRef[pa.Buffer]) -> None:
    """Collect the error of a failed result we will not use, so Ray does not report it."""
    try:
        ray.get(ref, timeout=0)
    except Exception:  # the error is the one already handled
        pass
