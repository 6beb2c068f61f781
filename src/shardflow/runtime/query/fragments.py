"""How a query's fragments reach the workers when they do not go over a fast lane: each is
submitted to its node's worker and its result collected, or abandoned when the query failed
elsewhere. Through the worker protocol (:class:`WorkerCalls`: the rows come back with the
answer) or through Ray's object store (the session's Ray calls: the rows stay on the worker
until a later stage or the client reads them)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import pyarrow as pa

from shardflow.errors import Error
from shardflow.runtime.protocol import FragmentStats, Reply, Workers
from shardflow.runtime.query.executor import FragmentResult, Materialized, Output

ABANDON_WAIT_S = 1.0
"""How long a failed query waits for its other fragments' outcomes, only to collect them."""


class Pending(Protocol):
    """A fragment on its way to its worker and back."""

    def result(self) -> FragmentResult:
        """Wait for the fragment: its result, or the worker's error (``Moved``, a worker
        gone, the query's own error)."""
        ...

    def abandon(self) -> None:
        """Its query failed elsewhere: collect its outcome (waiting a moment for one still
        running) and drop its result, so that nothing reports it as unhandled."""
        ...


class FragmentCalls(Protocol):
    """Submits a query's fragments to the workers. One per query: inputs it sends for the
    query's later stages go once, however many workers read them."""

    def submit(
        self,
        node: str,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        inputs: Mapping[str, Output],
        profile: bool,
        commits: Mapping[str, int] | None = None,
    ) -> Pending:
        """Ask ``node``'s worker to run a fragment (``WorkerGone`` where none runs) over
        the tables at ``commits``."""
        ...


class WorkerCalls:
    """Fragments through the worker protocol: the inputs go along, the rows come back."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    def submit(
        self,
        node: str,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        inputs: Mapping[str, Output],
        profile: bool,
        commits: Mapping[str, int] | None = None,
    ) -> Pending:
        worker = self.workers.get(node)
        tables = {name: value.table() for name, value in inputs.items()}
        submitted = time.time()
        reply = worker.execute(sql, bindings, epoch, profile, tables, commits)
        return _Answer(node, reply, submitted)


class _Answer:
    """A fragment asked through the worker protocol."""

    def __init__(
        self, node: str, reply: Reply[tuple[pa.Table, FragmentStats]], submitted: float
    ) -> None:
        self.node = node
        self.reply = reply
        self.submitted = submitted

    def result(self) -> FragmentResult:
        table, stats = self.reply.get()
        output = Materialized(table)
        return FragmentResult(
            output, self.node, stats.seconds, stats.rows_out, stats, self.submitted
        )

    def abandon(self) -> None:
        try:
            self.reply.get(ABANDON_WAIT_S)
        except Error:
            pass
