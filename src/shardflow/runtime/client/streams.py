"""Answers read as they arrive (``Database.stream``; the Flight SQL service's DoGet): where
a query's answer is its fragments' results put one after the other (a scan, a filter, a
projection: one stage over the shards, no merge), each worker's part goes to the reader as
soon as that worker has it, in record batches of at most ``STREAM_FRAME_BYTES``, and no
more than ``stream_buffer_mb`` of them wait in the client at once: the parts still to read
wait on the workers (their senders block), so the client's memory stays bounded whatever
the answer's size. Where the merge only orders the parts (``ORDER BY``, a ``LIMIT`` after
it: ``sql/merges.py``), each worker sorts its part and the parts are interleaved as they
arrive (``runtime/query/merging.py``): the first rows leave once every worker sorted its
part, and the client holds about a batch per worker. Any other query is answered whole
first and then handed out in batches.

A part that a worker could not run (it moved, the worker died before answering) runs again
with fresh routing, as any fragment does, while the others are read; a part whose units were
split or merged since, or a table truncated, starts the answer over where nothing was read
yet, and ends it with ``AnswerInterrupted`` otherwise (rows read twice or missing are never
handed out): the reader runs the query again. A worker that dies while its part is sent ends
the answer the same way."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Protocol

import pyarrow as pa

from shardflow.catalog import Catalog
from shardflow.engine.duckdb_engine import as_schema
from shardflow.errors import (
    AnswerInterrupted,
    Changed,
    ClusterError,
    QueryError,
    Retryable,
    StageRefused,
)
from shardflow.runtime.client.retry import Unfinished
from shardflow.runtime.client.runner import RoutedRunner, RunnerHost, stage_units, units_by_node
from shardflow.runtime.fastlane import STREAM_FRAME_BYTES, LaneBroken, slices
from shardflow.runtime.query.executor import ExecutionReport, PlanOutdated
from shardflow.runtime.query.fragments import FragmentCalls
from shardflow.runtime.query.merging import SortedParts, UnsortableKey
from shardflow.runtime.query.planning import PlannedQuery
from shardflow.sql import DistributedPlan
from shardflow.sql.merges import SortedMerge, sorted_merge
from shardflow.sql.plan import WHOLE

log = logging.getLogger(__name__)
STREAM_ATTEMPTS = 3
"""Times an answer starts over (a table truncated, units split while nothing was read)."""


class StreamClosed(Exception):
    """The reader closed the answer: its parts stop being read."""


class StreamHost(RunnerHost, Protocol):
    """What an answer read as it arrives needs of its session."""

    def plan(self, sql: str) -> PlannedQuery: ...
    def query(
        self, sql: str, planned: PlannedQuery | None = None
    ) -> tuple[pa.Table, ExecutionReport]: ...
    def refresh(self, more: list[str]) -> Catalog: ...
    def fragment_calls(self) -> FragmentCalls: ...
    def tally_query(self, seconds: float, ok: bool) -> None: ...


class AnswerStream:
    """An answer's record batches, in the order they arrive, with at most ``limit`` bytes
    of them held here at once (one batch at least). Iterate it once; :meth:`close` it when
    read no further (its parts stop being read)."""

    def __init__(self, schema: pa.Schema, limit: int) -> None:
        self.schema = schema
        self.limit = limit
        self.most_held = 0
        """The most bytes of batches held at once (for tests and the bench)."""
        self.delivered = 0
        """Batches taken by the reader so far."""
        self._cond = threading.Condition()
        self._batches: deque[pa.RecordBatch] = deque()
        self._held = 0
        self._error: BaseException | None = None
        self._finished = False
        self._closed = False

    @classmethod
    def of_table(cls, table: pa.Table, limit: int) -> AnswerStream:
        """An answer held whole already, handed out in batches."""
        stream = cls(table.schema, max(limit, table.nbytes))
        for part in slices(table, STREAM_FRAME_BYTES):
            stream.put(part)
        stream.finish()
        return stream

    # -- the side that fills it -----------------------------------------------------------
    def put(self, part: pa.Table) -> None:
        """Add ``part``'s rows; waits while the batches held are ``limit`` bytes or more.
        :class:`StreamClosed` once the reader closed the answer."""
        for batch in part.to_batches() or [pa.RecordBatch.from_pylist([], part.schema)]:
            with self._cond:
                while not self._closed and self._held and self._held + batch.nbytes > self.limit:
                    self._cond.wait()
                if self._closed:
                    raise StreamClosed
                self._batches.append(batch)
                self._held += batch.nbytes
                self.most_held = max(self.most_held, self._held)
                self._cond.notify_all()

    def discard(self) -> bool:
        """Drop the batches held, to start the answer over: whether that was possible
        (False once the reader took one)."""
        with self._cond:
            if self.delivered:
                return False
            self._batches.clear()
            self._held = 0
            self._cond.notify_all()
            return True

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """End the answer with ``error``: the reader gets it at its next batch."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # -- the reader's side ----------------------------------------------------------------
    def __iter__(self) -> Iterator[pa.RecordBatch]:
        try:
            while True:
                with self._cond:
                    while not (self._batches or self._error or self._finished or self._closed):
                        self._cond.wait()
                    if self._error is not None:
                        raise self._error
                    if not self._batches:
                        return
                    batch = self._batches.popleft()
                    self._held -= batch.nbytes
                    self.delivered += 1
                    self._cond.notify_all()
                yield batch
        finally:
            self.close()

    def reader(self) -> pa.RecordBatchReader:
        """The answer as a ``RecordBatchReader`` (closing it closes the answer)."""
        return pa.RecordBatchReader.from_batches(self.schema, iter(self))

    def close(self) -> None:
        """Read no further: the parts still being read stop."""
        with self._cond:
            self._closed = True
            self._batches.clear()
            self._held = 0
            self._cond.notify_all()


def streams(plan: DistributedPlan, units: int) -> bool:
    """Whether ``plan``'s answer is read as it arrives: one stage over the shards (of
    ``units`` units), nothing merged, not routed to the units of a key's values, and not
    run whole on one worker where its tables are one unit. The last two are answered whole:
    most are a key lookup's or an aggregate's few rows, which came later read in parts (a
    lookup on a table of one unit 3.7-4.1 against 2.2-2.8 ms in process, SF 0.1: the
    session's threads and the worker's lane hand the rows on), and a table of one unit is
    mostly small (a new table gets a unit per ``initial_shard_bytes``; but on one worker,
    every table is one unit: its answers are held whole)."""
    stage = plan.result
    return (
        len(plan.stages) == 1
        and stage.placement == "shards"
        and stage.merge_sql is None
        and not stage.inputs
        and stage.buckets is None
        and (stage.strategy != WHOLE or units > 1)
    )


def merged_in_order(plan: DistributedPlan) -> SortedMerge | None:
    """The sorted merge of ``plan``'s answer where its parts are interleaved as they arrive:
    one stage over the shards, not routed, its merge only an ordering on the client."""
    stage = plan.result
    if (
        len(plan.stages) != 1
        or stage.placement != "shards"
        or stage.inputs
        or stage.buckets is not None
        or stage.merge_on != "client"
    ):
        return None
    return sorted_merge(stage.merge_sql)


def open_stream(session: StreamHost, sql: str) -> AnswerStream:
    """``sql``'s answer as it arrives (see the module)."""
    limit = session.settings.stream_buffer_mb << 20
    planned = session.plan(sql)
    group = session.catalog.groups.get(planned.plan.result.group or "")
    merge = merged_in_order(planned.plan) if group is not None else None
    if merge is not None:
        read: Callable[[StreamHost, PlannedQuery, AnswerStream], None] = partial(
            _read_sorted, merge=merge
        )
    elif group is not None and streams(planned.plan, len(group.units)):
        read = _read_parts
    else:
        table, _ = session.query(sql, planned)  # planned once (a key lookup's few ms)
        return AnswerStream.of_table(table, limit)
    stream = AnswerStream(planned.schema, limit)
    threading.Thread(
        target=_fill,
        args=(session, sql, planned, stream, read),
        name="shardflow-stream",
        daemon=True,
    ).start()
    return stream


def _fill(
    session: StreamHost,
    sql: str,
    planned: PlannedQuery,
    stream: AnswerStream,
    read: Callable[[StreamHost, PlannedQuery, AnswerStream], None],
) -> None:
    started = time.perf_counter()
    try:
        for attempt in range(STREAM_ATTEMPTS):
            try:
                read(session, planned, stream)
                break
            except Changed as error:  # truncated: parts read before must not meet later ones
                if attempt + 1 == STREAM_ATTEMPTS:
                    raise ClusterError(f"the query's tables kept changing: {error}") from None
                if not stream.discard():
                    raise AnswerInterrupted(
                        f"{error.table} was truncated while the answer was read; "
                        "run the query again"
                    ) from None
                session.refresh([error.table])
            except (StageRefused, PlanOutdated, UnsortableKey) as error:
                if not stream.discard():
                    raise AnswerInterrupted(
                        f"the answer cannot be finished ({error}); run the query again"
                    ) from None
                stream.put(session.query(sql)[0])
                break
        stream.finish()
        session.tally_query(time.perf_counter() - started, True)
    except StreamClosed:
        pass
    except BaseException as error:
        session.tally_query(time.perf_counter() - started, False)
        stream.fail(error)


def _read_parts(session: StreamHost, planned: PlannedQuery, stream: AnswerStream) -> None:
    """Each worker's part of the one stage, read into ``stream`` as it comes; parts a worker
    could not run go again with fresh routing until every unit's rows are read."""
    stage = planned.plan.result
    runner = RoutedRunner(session, session.fragment_calls())
    pending: set[int] | None = None

    def attempt() -> None:
        nonlocal pending
        catalog = session.catalog
        commits = runner.commits(stage.tables)
        group, current = stage_units(stage, catalog)
        if pending is None or pending - current:
            if pending is not None and not stream.discard():
                raise AnswerInterrupted(
                    "the query's shards were split or merged while its answer was "
                    "read; run the query again"
                )
            pending = set(current)
        by_node = units_by_node(group, pending)
        if stage.strategy == WHOLE and len(by_node) > 1:  # planned on one node: on several now
            raise PlanOutdated(f"a query planned whole has its shards on {len(by_node)} nodes")
        # a query run whole is one part; any other, a part per unit, each worker's in turn:
        # the first rows leave once one unit's part is ready, not the worker's whole share
        parts = {
            node: [units] if stage.strategy == WHOLE else [[unit] for unit in units]
            for node, units in by_node.items()
        }
        outcomes: dict[str, list[tuple[list[int], BaseException | None]]] = defaultdict(list)

        def read(node: str) -> None:
            for units in parts[node]:
                bindings = {table: units for table in stage.tables}
                try:
                    outcome = _read_part(
                        session, stream, node, stage.sql, bindings, catalog.epoch, commits,
                        planned.schema,
                    )  # fmt: skip
                except BaseException as error:  # rows of it may be read: never asked again
                    outcome = (
                        error  # the query's own error (a value that does not convert) too
                        if isinstance(error, AnswerInterrupted | StreamClosed | QueryError)
                        else AnswerInterrupted(
                            f"{node}'s part of the answer failed while it was read: {error!r}"
                        )
                    )
                outcomes[node].append((units, outcome))
                if outcome is not None:  # the rest of the node's parts wait for a retry
                    return

        threads = [threading.Thread(target=read, args=(node,), daemon=True) for node in parts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failed: BaseException | None = None
        for node, read_parts in outcomes.items():
            for units, outcome in read_parts:
                if outcome is None:
                    pending -= set(units)
                elif isinstance(outcome, LaneBroken):  # asked the other way next attempt
                    session.lanes.broken(node, outcome)
                elif isinstance(outcome, Retryable):
                    log.info("a part of a streamed answer is asked again after %s failed: %s",
                             node, outcome)  # fmt: skip
                else:
                    failed = failed or outcome
        if failed is not None:
            raise failed
        if pending:
            raise Unfinished(f"{len(pending)} unit(s) of the answer still to read")

    session.retrying("query", attempt)


def _read_sorted(
    session: StreamHost, planned: PlannedQuery, stream: AnswerStream, merge: SortedMerge
) -> None:
    """Each worker's part sorted by the merge's keys (one fragment over all its units), the
    parts interleaved as they arrive. A part that cannot start (a unit moved, a worker
    gone) starts the answer again with fresh routing; a part that fails once rows went out
    ends it with :class:`AnswerInterrupted`."""
    stage = planned.plan.result
    runner = RoutedRunner(session, session.fragment_calls())
    sql = merge.part_sql(stage.sql)
    columns = list(merge.columns)

    def attempt() -> None:
        catalog = session.catalog
        commits = runner.commits(stage.tables)
        group, units = stage_units(stage, catalog)
        by_node = units_by_node(group, units)
        opened: dict[str, Iterator[pa.Table] | BaseException] = {}

        def open_part(node: str) -> None:  # all at once: each worker sorts its part first
            bindings = {table: by_node[node] for table in stage.tables}
            try:
                opened[node] = _part_of(session, node, sql, bindings, catalog.epoch, commits)
            except BaseException as error:  # raised below, on the reading thread
                opened[node] = error

        threads = [threading.Thread(target=open_part, args=(node,)) for node in by_node]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        parts = [part for part in opened.values() if not isinstance(part, BaseException)]
        try:
            failed = next((e for e in opened.values() if isinstance(e, BaseException)), None)
            if failed is not None:
                if isinstance(failed, LaneBroken):
                    node = next(n for n, e in opened.items() if e is failed)
                    session.lanes.broken(node, failed)
                    raise Unfinished(f"{node}'s fast lane broke: {failed}")
                raise failed  # a Retryable one is asked again with fresh routing
            for table in SortedParts(parts, merge):  # up to a batch of each part at once
                for frame in slices(table.select(columns), STREAM_FRAME_BYTES):
                    stream.put(as_schema(frame, planned.schema))
        except (LaneBroken, Retryable) as error:
            if stream.discard():  # nothing went out: the whole answer again
                raise Unfinished(f"a part of the sorted answer failed: {error}") from None
            raise AnswerInterrupted(
                f"a worker could not finish its part of the sorted answer ({error}); "
                "run the query again"
            ) from None
        finally:
            for part in parts:
                close: Callable[[], None] | None = getattr(part, "close", None)
                if close is not None:
                    close()

    session.retrying("query", attempt)


def _read_part(
    session: StreamHost,
    stream: AnswerStream,
    node: str,
    sql: str,
    bindings: dict[str, list[int]],
    epoch: int,
    commits: dict[str, int],
    schema: pa.Schema,
) -> BaseException | None:
    """Read ``node``'s part into ``stream``: None when read whole; what failed before any
    of its rows was read (to ask again); raises :class:`AnswerInterrupted` where it failed
    after."""
    try:
        parts = _part_of(session, node, sql, bindings, epoch, commits)
    except Exception as error:
        return error
    try:
        for part in parts:
            stream.put(as_schema(part, schema))
    except LaneBroken as error:
        raise AnswerInterrupted(
            f"{node} went away while it sent its part of the answer ({error}); run the query again"
        ) from None
    except Retryable as error:  # after some of its rows: it cannot be asked again
        raise AnswerInterrupted(
            f"{node} could not finish its part of the answer ({error}); run the query again"
        ) from None
    finally:
        close: Callable[[], None] | None = getattr(parts, "close", None)
        if close is not None:
            close()
    return None


def _part_of(
    session: StreamHost,
    node: str,
    sql: str,
    bindings: dict[str, list[int]],
    epoch: int,
    commits: dict[str, int],
) -> Iterator[pa.Table]:
    """``node``'s part as it makes it, over its fast lane (raises what failed before the
    first batch); without a lane, the fragment call's result, whole, in frames."""
    address = session.lanes.address(node)
    if address is not None:
        return session.lanes.lanes.stream(address, sql, bindings, epoch, commits)
    call = session.fragment_calls().submit(node, sql, bindings, epoch, {}, False, commits)
    return slices(call.result().output.table(), STREAM_FRAME_BYTES)
