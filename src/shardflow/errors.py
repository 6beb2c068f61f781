"""The errors shardflow raises: one small hierarchy rooted at :class:`Error`.

Every user-facing error says what was wrong and what to do about it. Retry semantics are
types (:class:`Retryable`, :class:`Moved`), never string matching.
"""

from __future__ import annotations

from collections.abc import Sequence


class Error(Exception):
    """Base class of every error shardflow raises on purpose."""


class ConfigError(Error, ValueError):
    """A bad argument to ``connect`` or a bad setting (wrong type, out of range)."""


class QueryError(Error):
    """A query could not be run. Subclasses say why; DuckDB's own message is kept."""


class SqlSyntaxError(QueryError):
    """The SQL text does not parse."""


class UnknownTableError(QueryError, KeyError):
    """A query, insert or drop names a table that does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownColumnError(QueryError):
    """A query or table definition names a column that does not exist."""


class UnsupportedError(QueryError):
    """A valid construct shardflow does not run (yet); the message names it."""


class UnreadableSql(UnsupportedError):
    """Internal: text DuckDB parses but shardflow's SQL parser cannot read. A SELECT that
    DuckDB binds runs as written over gathered tables; anything else stays unsupported."""


class NotDistributable(UnsupportedError):
    """Internal: the planner cannot take the query apart over shards (the message names
    the construct); a query DuckDB binds runs as written over gathered tables instead."""


class StageRefused(QueryError):
    """Internal: DuckDB refused the SQL of a stage the planner wrote (a parser, binder or
    catalog error, not an error in the data); the session runs the query as written."""


class TableError(Error):
    """A table definition is invalid (bad source, bad distribution column, ...)."""


class TableExistsError(TableError):
    """``create_table`` was asked for a name that is already taken."""


class SchemaMismatchError(Error, TypeError):
    """Inserted data does not fit the table: missing, extra or mistyped columns, or NULLs
    in a NOT NULL column. Nothing of the insert was written."""


class UnknownShardError(Error, KeyError):
    """A cluster operation names a shard or node that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MoveRefusedError(Error):
    """A migration, split, merge or drain cannot be done as asked (the message says why);
    nothing was changed."""


class MigrationError(MoveRefusedError):
    """A live move failed and was rolled back: the source kept serving, nothing was lost.
    ``record`` is the move as ``db.cluster.migrations()`` keeps it (phase times, cause)."""

    def __init__(self, message: str, record: object = None) -> None:
        super().__init__(message)
        self.record = record


class MoveCancelled(MoveRefusedError):
    """A move an operator cancelled (``db.cluster.cancel``) stopped where it was and rolled
    back: the source kept serving, nothing was lost."""


class DrainTimeoutError(MoveRefusedError):
    """A drain did not finish by its deadline; the node keeps serving what it still holds.
    ``moved`` lists the moves that did finish."""

    def __init__(self, message: str, moved: Sequence[object] | None = None) -> None:
        super().__init__(message)
        self.moved = list(moved or [])


class ClusterError(Error):
    """The cluster could not serve the request (workers unreachable past the retry deadline)."""


class AnswerInterrupted(ClusterError):
    """An answer read as it arrives (``db.stream``, the Flight SQL service's answers) cannot
    be finished: rows were handed out already, and the cluster changed so that the rest
    cannot be read at the routing they were read at (a worker died while it sent its part,
    units were split or merged, a table truncated). Run the query again; the rows read are
    never given twice or with some missing."""


class StorageError(Error):
    """The data directory refused a write: its file system is full or read-only. Nothing of
    the operation was kept (an insert was not acknowledged); the same operation succeeds
    once the storage takes writes again, without a restart."""


class ClosedError(Error):
    """The database was closed: calls in flight when ``close()`` ran, and every call after,
    end with this. Call ``shardflow.connect()`` again."""


class DataDirInUseError(Error):
    """``connect`` found the data directory served by another live shardflow cluster (a
    data directory has one owner at a time); the message names it."""


class OwnershipLostError(ClusterError):
    """Another cluster took over the data directory (this one hung past its lease, or was
    taken for dead): this cluster's writes are refused. Reconnect."""


class Retryable(ClusterError):
    """Internal: a transient condition; the caller refreshes its view and tries again."""


class WorkerGone(Retryable):
    """Internal: the worker of a node the routing named has stopped (drained, or dead and
    not yet failed over); the caller refreshes routing and tries again."""


class WorkerTimeout(Retryable):
    """Internal: a worker (or the coordinator) did not answer in time; it may be busy or
    dying, and the caller decides whether to ask again."""


class NodeFault(Retryable):
    """Internal: the node failed this operation (a device, memory or I/O error, or the
    test hook ``test_flaky_node``); the caller tries again. It counts toward the node's
    failure rate, which makes a failing node suspect (``node_failure_rate``)."""


class ResultLost(ClusterError):
    """Internal: a result left on a node (in Ray's object store) was lost with it; the query
    that needs it runs again."""


class Moved(Retryable):
    """Internal: a worker no longer owns a shard at the routing epoch it was asked for."""

    def __init__(self, shard: str, epoch: int) -> None:
        super().__init__(f"shard {shard} is not served here at routing epoch {epoch}")
        self.shard = shard
        self.epoch = epoch

    def __reduce__(self) -> tuple[type[Moved], tuple[str, int]]:
        return (Moved, (self.shard, self.epoch))


class Changed(ClusterError):
    """Internal: a table's rows were changed (``TRUNCATE``) since the routing a query or
    insert was made with: the query runs again whole, the insert sends every part again
    (not Retryable: parts read or written before the change must not be kept)."""

    def __init__(self, table: str, commit: int, now: int) -> None:
        super().__init__(f"table {table} is at commit {now}, not {commit}")
        self.table = table
        self.commit = commit
        self.now = now

    def __reduce__(self) -> tuple[type[Changed], tuple[str, int, int]]:
        return (Changed, (self.table, self.commit, self.now))


class AuthenticationError(Error):
    """The service did not accept the caller: a wrong user name or password, or an
    unknown, revoked or expired token. Nothing was run."""


class PermissionDeniedError(Error):
    """The caller's role does not allow the call; the message names the role it needs.
    Nothing was changed."""
