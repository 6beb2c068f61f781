"""Where the runner sends shardflow's side of each comparison: a real local cluster (the make
target and the test), or the in-process :class:`InMemoryCluster` (a faster check while
developing; it runs the real planner and executor, but not the session's validation)."""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Protocol

import pyarrow as pa

__all__ = ["Backend", "ClusterBackend", "InMemoryBackend", "QueryTimeout", "make_backend"]


class Backend(Protocol):
    name: str
    restarts: int
    """How often the backend was started afresh (its tables then are gone)."""

    def create_table(
        self,
        name: str,
        data: pa.Table,
        *,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
    ) -> None: ...

    def drop_table(self, name: str) -> None: ...

    def sql(self, query: str) -> pa.Table: ...

    def close(self) -> None: ...


class QueryTimeout(Exception):
    """shardflow gave no answer in time; the runner restarted the cluster."""


BALANCERS: dict[str, dict[str, object]] = {
    "default": {},
    # every hot unit split, every 0.3 s: tables are created, loaded and read while their
    # units split under them (how a create racing a split was found to lose rows)
    "splitting": {"min_shard_bytes": 1, "balance_interval_s": 0.3},
    # four units a worker merged as soon as they are cold, and units moved at the least
    # imbalance
    "merging": {
        "shards_per_worker": 4,
        "min_shard_bytes": 1 << 30,
        "max_shard_bytes": 1 << 31,
        "balance_interval_s": 0.3,
        "balance_tolerance": 0.01,
    },
}
"""Balancer settings the cluster backend can run under (``--balancer``)."""


class ClusterBackend:
    """One embedded shardflow cluster for the whole run, its data in a temporary folder.

    A query that has not answered after ``query_timeout_s`` raises :class:`QueryTimeout`
    (a wrong case) and the cluster is started afresh (``restarts`` counts it), so that one
    hung query cannot stop the run; the runner then loads its tables again."""

    name = "cluster"

    def __init__(
        self,
        workers: int = 3,
        query_timeout_s: float = 60.0,
        balancer: str = "default",
        in_process: bool = False,
    ) -> None:
        # A failed fragment is reported to us as a ClusterError; Ray's own copy of it on
        # stderr would bury the runner's output.
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if balancer not in BALANCERS:
            raise ValueError(f"unknown balancer {balancer!r} ({', '.join(BALANCERS)})")
        self.workers = workers
        self.in_process = in_process
        """The cluster in this process (``connect(in_process=True)``), not on Ray."""
        self.query_timeout_s = query_timeout_s
        self.balancer = BALANCERS[balancer]
        self.restarts = 0
        self._connect()

    def _connect(self) -> None:
        import shardflow

        self._dir = tempfile.TemporaryDirectory(prefix="shardflow-conformance-")
        # the corpus's tables are tiny: spread them anyway, so that every query runs distributed
        self.db = shardflow.connect(
            workers=self.workers,
            data_dir=self._dir.name,
            in_process=self.in_process,
            initial_shard_bytes=0,
            **self.balancer,
        )

    def restart(self) -> None:
        """A new cluster first, then the old one closed: Ray itself stays up, so the hung
        query's thread only meets dead actors (and gives up after retry_deadline_s)."""
        old_db, old_dir = self.db, self._dir
        self._connect()
        self.restarts += 1
        try:
            old_db.close()
        except Exception:
            pass  # it is gone either way
        old_dir.cleanup()

    def create_table(
        self,
        name: str,
        data: pa.Table,
        *,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
    ) -> None:
        self.db.create_table(
            name,
            data,
            distributed_by=distributed_by,
            replicated=replicated,
            colocate_with=colocate_with,
        )

    def drop_table(self, name: str) -> None:
        self.db.drop_table(name)

    def sql(self, query: str) -> pa.Table:
        box: list[pa.Table | BaseException] = []

        def run(db: object = self.db) -> None:
            try:
                box.append(db.sql(query))  # type: ignore[attr-defined]
            except BaseException as error:
                box.append(error)

        worker = threading.Thread(target=run, name="conformance-query", daemon=True)
        worker.start()
        worker.join(self.query_timeout_s)
        if worker.is_alive() or not box:
            self.restart()
            raise QueryTimeout(
                f"no answer within {self.query_timeout_s:g} s; the runner restarted the cluster"
            )
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def close(self) -> None:
        self.db.close()
        self._dir.cleanup()


class InMemoryBackend:
    """The planner and executor over in-process shards (3 nodes, 2 units each)."""

    name = "inmemory"
    restarts = 0

    def __init__(self, workers: int = 3) -> None:
        from shardflow.engine import DuckDBEngine
        from tests.support.inmemory import InMemoryCluster

        self.cluster = InMemoryCluster(nodes=workers, units_per_node=2)
        self.engine = DuckDBEngine(threads=1)

    def create_table(
        self,
        name: str,
        data: pa.Table,
        *,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
    ) -> None:
        from shardflow.errors import TableExistsError

        if name in self.cluster.catalog.tables:
            raise TableExistsError(f"table {name!r} exists")
        try:
            self.cluster.create_table(name, data, distributed_by, colocate_with, replicated)
        except BaseException:
            self.drop_table(name)  # like the real cluster: a failed load leaves nothing
            raise

    def drop_table(self, name: str) -> None:
        if name in self.cluster.catalog.tables:
            self.cluster.catalog = self.cluster.catalog.without_table(name)
        self.cluster.replicated.pop(name, None)
        for key in [k for k in self.cluster.shards if k[0] == name]:
            del self.cluster.shards[key]

    def sql(self, query: str) -> pa.Table:
        return self.cluster.sql(query, self.engine)

    def close(self) -> None:
        pass


def make_backend(
    kind: str, workers: int = 3, query_timeout_s: float = 60.0, balancer: str = "default"
) -> Backend:
    if kind in ("cluster", "process"):
        return ClusterBackend(workers, query_timeout_s, balancer, in_process=kind == "process")
    if kind == "inmemory":
        return InMemoryBackend(workers)
    raise ValueError(f"unknown backend {kind!r} (cluster, process or inmemory)")
