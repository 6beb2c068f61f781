"""The CPU engine: DuckDB. It runs SQL over named Arrow tables (registered without copying)
and, on a worker, holds shards as native DuckDB tables, which scan about 1.5x faster than
Arrow and need no registration per query. A table's shards on a node are served through a
view with the table's name, so fragments run as written."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from shardflow.errors import (
    QueryError,
    SchemaMismatchError,
    StageRefused,
    StorageError,
    UnsupportedError,
)
from shardflow.storage.shard import RowRewrite, returning_query
from shardflow.storage.shard_store import CheckpointMeta

log = logging.getLogger(__name__)

CLOSE_ATTEMPTS = 50
CLOSE_RETRY_S = 0.02
SEAL_ATTEMPTS = 20
"""How often the CHECKPOINT that makes a new checkpoint file durable is asked for while
DuckDB refuses it for another write transaction (each wait a little longer)."""
COMPACT_AFTER_BYTES = 64 << 20
"""Bytes appended to native tables (as Arrow) after which the compactor compresses them."""
DEFER_AT_MOST_S = 30.0
"""How long bulk work may hold compaction back before it runs anyway."""
COMPACTOR_CLOSE_WAIT_S = 30.0
NO_AUTO_CHECKPOINT = "1000000GiB"


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def checksum_sql(select: str) -> str:
    """A query of (n: rows, h: sum of DuckDB's row hashes) over what ``select`` returns."""
    return f"SELECT count(*) AS n, coalesce(sum(hash(s)::HUGEINT), 0) AS h FROM ({select}) AS s"


SHARD_TABLE = "rows"
"""The name of a shard's table inside the shard's own databases and its checkpoint files
(see :class:`NativeRows`)."""
SHARD_VIEW = "shard"
"""The name of the view of a shard's rows in the shard's own database."""
LSN_COLUMN = "_sf_lsn"
"""The column of a shard's tail that says at which LSN each row was logged."""
_DATABASES = itertools.count(1)
"""Numbers the databases attached for checkpoint files: unique in the process (a unit may
be served again on a node while a retired copy of it is still read)."""
REWRITE_SHARE = 4
"""Once one in this many of the rows a checkpoint file holds are deleted rows (a DELETE run
in a copy of the file leaves their slots), the next change or checkpoint writes the rows
again whole: a change that would leave so many writes them whole at once; a smaller one
changes a copy of the checkpoint file in place."""


def _mostly_dead(live: int, dead: int) -> bool:
    """Whether a file holding ``live`` rows and ``dead`` deleted ones wants compacting."""
    return dead > 0 and dead * REWRITE_SHARE >= live + dead


CHANGED_ROWS = "shardflow_changed"
"""The table an UPDATE keeps the ids of the rows it changes in, in the file it changes."""
CHECKPOINT_TABLE = "shardflow_checkpoint"
"""The table in a checkpoint file that says up to which LSN it holds the rows."""
KEY_INDEX = "key_index"
"""The name of a shard's index on its table's key (``create_table(key_index=True)``)."""
ARROW_BATCH_ROWS = 131_072
"""Rows per record batch of a result (DuckDB's own default)."""
DIRECT_SUBMIT = callable(getattr(duckdb.DuckDBPyConnection, "_submit", None))
"""Whether this DuckDB runs a statement straight to Arrow (see :func:`as_arrow`)."""


def as_arrow(cursor: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """The result of one statement as Arrow. DuckDB 2's ``cursor.sql(text)`` builds a lazy
    relation: it binds the statement to learn its columns, and running it binds it again,
    which for a point lookup was a quarter of the worker's time (731 -> 523 us of CPU a
    lookup, measured interleaved). Its connection runs a statement straight to Arrow
    (``_submit``, what the relation calls in the end): used where this DuckDB has it,
    the relation otherwise. (The relation would also read Python variables a query names;
    shardflow registers every table it means a query to read.)"""
    if DIRECT_SUBMIT:
        return cursor._submit(sql, None, "arrow", ARROW_BATCH_ROWS).arrow_table()
    return cursor.sql(sql).to_arrow_table()


_STARTS_WITH = re.compile(r"\s*(WITH\s+RECURSIVE\s|WITH\s|SELECT\s|SELECT\*)", re.IGNORECASE)


def with_views(sql: str, views: Mapping[str, str]) -> str | None:
    """``sql`` with ``views`` as leading common table expressions (inlined, never
    materialized), or None when it cannot be written so: a statement that does not begin
    with SELECT or WITH, or one that may define a CTE of a view's name already. Costs
    nothing, where a temporary view is DDL (a catalog change) on every call."""
    found = _STARTS_WITH.match(sql)
    if found is None:
        return None
    for name in views:
        if re.search(rf"{re.escape(quote(name))}\s+AS|\b{re.escape(name)}\s+AS\s*\(", sql, re.I):
            return None
    ctes = ", ".join(f"{quote(n)} AS NOT MATERIALIZED ({s})" for n, s in views.items())
    lead = found.group(1)
    if lead.upper().startswith("SELECT"):
        return f"WITH {ctes} {sql}"
    return f"{sql[: found.end(1)]}{ctes}, {sql[found.end(1) :]}"


class DuckDBEngine:
    """Runs SQL text over named Arrow tables and native tables. Thread-safe: every call
    works on a connection of its own."""

    name = "duckdb"

    def __init__(
        self,
        threads: int | None = None,
        memory_limit: str | None = None,
        temp_directory: str | None = None,
        compact_after_bytes: int = COMPACT_AFTER_BYTES,
        file_folders: Sequence[str] = (),
    ) -> None:
        """``memory_limit`` (DuckDB's syntax, "512MB") bounds DuckDB's buffer manager; with
        a ``temp_directory`` (a local folder of this engine's own) table blocks and the
        state of big operators spill there beyond it, so the shards a worker holds may
        exceed its memory. New rows of native tables are compressed in the background once
        ``compact_after_bytes`` were appended (see :class:`Compactor`). Shards' checkpoint
        files are opened in ``file_folders`` only (and in the temporary directory)."""
        # DuckDB's allocator hands freed pages back to the system on threads of its own:
        # without them it does so only while it allocates, and a shard compressed after
        # a load kept the uncompressed rows' pages (measured: 1.5 M lineitem rows, 360 MB
        # resident after the checkpoint instead of 135 MB)
        config: dict[str, str | int | bool] = {"allocator_background_threads": True}
        if threads:
            config["threads"] = threads
        if memory_limit:
            config["memory_limit"] = memory_limit
        if temp_directory:
            config["temp_directory"] = temp_directory
        self._database = duckdb.connect(":memory:", config=config)
        self.scratch = temp_directory or tempfile.gettempdir()
        """A local folder for checkpoint files the data directory cannot be read from
        in place."""
        # SQL reaches data only through shardflow's tables: no file, no network, no
        # ATTACH (a query over the Flight service must not read the server's files), and
        # a query cannot turn that back on; but the engine itself attaches shards'
        # checkpoint files in their folders, which the SQL layer keeps queries out of
        # (``sql/parse.refuse_file_functions``). (Set after the temp directory, which it
        # locks.)
        folders = [*file_folders, *([temp_directory] if temp_directory else [])]
        if folders:
            listed = ", ".join(_literal(os.path.join(os.path.abspath(f), "")) for f in folders)
            self._database.execute(f"SET allowed_directories = [{listed}]")
        self._database.execute("SET enable_external_access = false")
        # DuckDB would compress new rows inside whichever commit crosses this threshold
        # (one INSERT waited 2-6 s): the compactor does it on a thread of its own instead
        self._database.execute(f"SET checkpoint_threshold = '{NO_AUTO_CHECKPOINT}'")
        self._ddl = threading.Lock()
        self.compactor = Compactor(self._database, compact_after_bytes, temp_directory)

    def memory(self) -> tuple[int, int]:
        """(bytes DuckDB holds in memory, bytes it has spilled to its temp directory)."""
        cursor = self._database.cursor()  # the shared connection refuses a second caller
        try:
            row = cursor.execute(
                "SELECT coalesce(sum(memory_usage_bytes), 0), "
                "coalesce(sum(temporary_storage_bytes), 0) FROM duckdb_memory()"
            ).fetchone()
        finally:
            cursor.close()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table] | None = None,
        views: Mapping[str, str] | None = None,
    ) -> pa.Table:
        """Execute ``sql``; each of ``tables`` is visible under its name, and each of
        ``views`` (name -> SELECT) shadows a same-named table for this call only."""
        cursor, sql = self._cursor_for(sql, tables, views)
        try:
            return as_arrow(cursor, sql)
        finally:
            cursor.close()

    def _cursor_for(
        self,
        sql: str,
        tables: Mapping[str, pa.Table] | None,
        views: Mapping[str, str] | None,
    ) -> tuple[duckdb.DuckDBPyConnection, str]:
        """A cursor where ``tables`` and ``views`` are visible, and ``sql`` as it runs there
        (with the views in front, where they can be written so)."""
        cursor = self._database.cursor()
        try:
            for name, table in (tables or {}).items():
                cursor.register(name, table)
            if views:
                inlined = with_views(sql, views)
                if inlined is not None:
                    return cursor, inlined
                for name, select in views.items():
                    cursor.execute(f"CREATE TEMP VIEW {quote(name)} AS {select}")
            return cursor, sql
        except BaseException:
            cursor.close()
            raise

    def run_in_parts(
        self,
        sql: str,
        emit: Callable[[pa.Table], None],
        tables: Mapping[str, pa.Table] | None = None,
        views: Mapping[str, str] | None = None,
    ) -> pa.Schema:
        """:meth:`run`, giving the result to ``emit`` in record batches as DuckDB makes them
        (of about :data:`ARROW_BATCH_ROWS` rows; none where the result has no rows) rather
        than whole at the end: the first rows leave before the last are read. Returns the
        result's schema once every batch was given."""
        cursor, sql = self._cursor_for(sql, tables, views)
        try:
            # the relation's reader runs the query as it is read (DIRECT_SUBMIT's runs it
            # whole first); it binds the statement twice, ~0.2 ms, which a scan big enough
            # to be read in parts does not notice
            with cursor.sql(sql).to_arrow_reader(ARROW_BATCH_ROWS) as reader:
                for batch in reader:
                    emit(pa.Table.from_batches([batch]))
                return reader.schema
        finally:
            cursor.close()

    def execute(self, statement: str, tables: Mapping[str, pa.Table] | None = None) -> None:
        """Run a statement that returns nothing (DDL, INSERT)."""
        cursor = self._database.cursor()
        try:
            for name, table in (tables or {}).items():
                cursor.register(name, table)
            cursor.execute(statement)
        finally:
            cursor.close()

    # -- native tables and the views that serve them -----------------------------------
    def native_rows(self, physical: str, schema: pa.Schema, index: str | None = None) -> NativeRows:
        return NativeRows(self, physical, schema, index)

    def indexed_databases(self) -> set[str]:
        """The shard databases whose table has its key index (see :class:`NativeRows`)."""
        found = self.run(
            "SELECT database_name AS d FROM duckdb_indexes() "
            f"WHERE table_name = '{SHARD_TABLE}' AND index_name = '{KEY_INDEX}'"
        )
        return set(found.column("d").to_pylist())

    def set_view(self, name: str, refs: list[str]) -> None:
        """Make ``name`` read the union of the native tables ``refs`` (their
        :attr:`NativeRows.ref`; drop the view when there are none)."""
        with self._ddl:
            if not refs:
                self.execute(f"DROP VIEW IF EXISTS {quote(name)}")
                return
            union = " UNION ALL ".join(f"SELECT * FROM {ref}" for ref in refs)
            self.execute(f"CREATE OR REPLACE VIEW {quote(name)} AS {union}")

    def checksum(
        self, select: str, tables: Mapping[str, pa.Table] | None = None
    ) -> tuple[int, int]:
        """(rows, sum of DuckDB row hashes) of a query: order-independent and additive, so
        the parts of a split add up to the whole; Arrow input and native tables of the same
        rows give the same sum."""
        row = self.run(checksum_sql(select), tables).to_pylist()[0]
        return int(row["n"]), int(row["h"])

    def checksum_rows(self, rows: pa.Table) -> tuple[int, int]:
        return self.checksum("SELECT * FROM __sf_rows", {"__sf_rows": rows})

    def execute_in_transaction(self, statements: Sequence[str]) -> None:
        """Run ``statements`` in one transaction (they change one database)."""
        cursor = self._database.cursor()
        try:
            cursor.execute("BEGIN TRANSACTION")
            try:
                for statement in statements:
                    cursor.execute(statement)
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
        finally:
            cursor.close()

    def attach(self, database: str) -> None:
        """An in-memory database of its own for one shard (made if missing)."""
        with self._ddl:
            self.execute(f"ATTACH IF NOT EXISTS ':memory:' AS {quote(database)}")

    def attach_file(self, database: str, path: str, *, read_only: bool = False) -> None:
        """A database file (a shard's checkpoint), made if missing unless ``read_only``."""
        mode = " (READ_ONLY)" if read_only else ""
        with self._ddl:
            self.execute(f"ATTACH {_literal(path)} AS {quote(database)}{mode}")

    def detach(self, database: str) -> None:
        """Drop a shard's database and its rows (readers still in it finish first)."""
        self.compactor.forget(database)
        with self._ddl:
            self.execute(f"DETACH DATABASE IF EXISTS {quote(database)}")

    def close(self) -> None:
        """Close the database; calls still running on other threads fail (DuckDB's
        ``ConnectionException``). DuckDB refuses a close that meets another call on the
        connection (``ResourceInUseException``) even though the connection then closes, so
        the close is asked again until it goes through."""
        self.compactor.close()
        for _ in range(CLOSE_ATTEMPTS - 1):
            try:
                self._database.close()
                return
            except duckdb.ResourceInUseException:
                time.sleep(CLOSE_RETRY_S)
        self._database.close()


@dataclass(frozen=True)
class Written:
    """What writing a change of a shard's rows gave (:meth:`NativeRows.write_change`)."""

    rows: int
    digest: int
    nbytes: int
    changed: int
    """The rows the statement changed (0: nothing was written)."""
    leaving: pa.Table | None = None
    """Rows an UPDATE of the key gave a key of another shard (new values)."""
    dead: int = 0
    """Rows deleted in place whose slots the file still holds."""
    returned: pa.Table | None = None
    """What the changed rows give back (``RowRewrite.returning``), or None."""


@dataclass(frozen=True)
class _Base:
    """A checkpoint file a shard reads its older rows from."""

    name: str
    """The attached database."""
    path: str
    meta: CheckpointMeta

    @property
    def table(self) -> str:
        return f"{quote(self.name)}.main.{SHARD_TABLE}"


class NativeRows:
    """A shard's rows in DuckDB (a :class:`shardflow.storage.CheckpointRows`): its newest
    checkpoint file, attached read-only where it lies (the *base*), and the rows logged
    since in a table of an in-memory database of the shard's own (the *tail*, each row with
    the LSN it was logged at), read together through a view, :attr:`ref`.

    Nothing the base holds is decoded and loaded again: a restart, a failover and a live
    move's target attach the file; a checkpoint copies it (a file copy), adds the tail's
    rows (only they are compressed), and the tail keeps what came after. A checkpoint of
    the tail's database (which compresses new rows, see :class:`Compactor`) blocks appends
    to it, so with a database per shard it holds up no other shard's inserts.

    With an ``index`` (a column's name) the tables keep an index on that column (DuckDB's
    ART): a query that looks up one value of it (``=``; DuckDB scans for IN lists) fetches
    its rows instead of scanning the shard. Compressed text costs a scan dearly (a point
    lookup that returns one row of TPC-H orders decoded the whole of o_comment's dictionary:
    1.05 ms against 0.55 ms by the index); the index costs memory (~33 bytes a row on
    orders' key) and ~35 % more time per insert."""

    def __init__(
        self, engine: DuckDBEngine, physical: str, schema: pa.Schema, index: str | None = None
    ) -> None:
        self.engine = engine
        self.physical = physical
        """The shard's in-memory database (its tail and its view)."""
        self.ref = f"{quote(physical)}.main.{SHARD_VIEW}"
        """The shard's rows, as SQL names them (a view)."""
        self.tail = f"{quote(physical)}.main.{SHARD_TABLE}"
        self.schema = schema
        self.index = index
        """The column the tables keep an index on, if any."""
        self.scratch = engine.scratch
        self._base: _Base | None = None
        self._retired: _Base | None = None
        """The base read before the last switch (see :meth:`_retire`)."""
        self._loading: str | None = None
        """The database a load stages its rows into (a new checkpoint file)."""
        self._loaded_bytes = 0
        self._tail_bytes = 0
        self._tail_rows = 0
        self._lock = threading.RLock()
        """Held by appends and by the switch to a new base (which empties the tail)."""
        engine.attach(physical)
        self._create_tail(schema.empty_table())

    # -- the tail ----------------------------------------------------------------------
    def _create_tail(self, rows: pa.Table, lsns: np.ndarray | None = None) -> None:
        """(Re)make the tail holding ``rows`` (row ``i`` logged at ``lsns[i]``; none: 0),
        and the view over it and the base."""
        tags = np.zeros(rows.num_rows, np.int64) if lsns is None else lsns
        tagged = rows.append_column(LSN_COLUMN, pa.array(tags, pa.int64()))
        self.engine.execute(
            f"CREATE OR REPLACE TABLE {self.tail} AS SELECT * FROM __sf_rows", {"__sf_rows": tagged}
        )
        if self.index is not None:
            self.engine.execute(f"CREATE INDEX {KEY_INDEX} ON {self.tail} ({quote(self.index)})")
        self.engine.execute(self._view_sql())
        self._tail_bytes = rows.nbytes
        self._tail_rows = rows.num_rows

    def _view_sql(self) -> str:
        """The view of the shard: the base's rows, then the tail's."""
        tail = f"SELECT * EXCLUDE ({LSN_COLUMN}) FROM {self.tail}"
        base = f"SELECT * FROM {self._base.table} UNION ALL " if self._base is not None else ""
        return f"CREATE OR REPLACE VIEW {self.ref} AS {base}{tail}"

    def append(self, table: pa.Table, lsn: int = 0) -> None:
        with self._lock:
            self.engine.execute(
                f"INSERT INTO {self.tail} SELECT *, {int(lsn)}::BIGINT FROM __sf_rows",
                {"__sf_rows": table},
            )
            self._tail_bytes += table.nbytes
            self._tail_rows += table.num_rows
        self.engine.compactor.appended(self.physical, table.nbytes)

    def reset(self, tables: list[pa.Table]) -> None:
        self.restore(None, None, tables, [0] * len(tables))

    # -- the base: checkpoint files ------------------------------------------------------
    def restore(
        self,
        checkpoint: str | None,
        meta: CheckpointMeta | None,
        tables: list[pa.Table],
        lsns: list[int],
    ) -> None:
        """Read the checkpoint file (if any) as the base and hold ``tables`` in the tail; a
        file that is not the checkpoint its record describes is refused (``StorageError``)
        and nothing changes."""
        data = pa.concat_tables(tables) if tables else self.schema.empty_table()
        tags = np.repeat(np.asarray(lsns, np.int64), [table.num_rows for table in tables])
        base = None
        if checkpoint is not None:
            assert meta is not None
            base = self._attach(checkpoint, meta)
        with self._lock:
            old, self._base = self._base, base
            self._create_tail(data, tags)
        self._retire(old)
        self.engine.compactor.appended(self.physical, data.nbytes)

    def begin_load(self, path: str) -> None:
        name = f"{self.physical}_load{next(_DATABASES)}"
        self.engine.attach_file(name, path)
        self.engine.execute(
            f"CREATE TABLE {quote(name)}.main.{SHARD_TABLE} AS SELECT * FROM __sf_rows",
            {"__sf_rows": self.schema.empty_table()},
        )
        self._loading = name
        self._loaded_bytes = 0

    def stage(self, table: pa.Table) -> None:
        """Rows of a load: into its checkpoint file, or the tail where it writes none (a
        copy of a replicated table that another node logs)."""
        if self._loading is None:
            self.append(table)
            return
        self.engine.execute(
            f"INSERT INTO {quote(self._loading)}.main.{SHARD_TABLE} SELECT * FROM __sf_rows",
            {"__sf_rows": table},
        )
        self._loaded_bytes += table.nbytes

    def finish_load(self) -> tuple[int, int, int]:
        assert self._loading is not None
        name, self._loading = self._loading, None
        try:
            rows, digest = self.engine.checksum(f"SELECT * FROM {quote(name)}.main.{SHARD_TABLE}")
            self._seal(name, 0, fresh=True)
        finally:
            self.engine.detach(name)
        return rows, digest, self._loaded_bytes

    def abandon_load(self) -> None:
        if self._loading is not None:
            name, self._loading = self._loading, None
            self.engine.detach(name)

    def _logged(self, upto: str) -> tuple[_Base | None, int, int, str]:
        """The base now, the tail's rows and bytes, and a query of the tail's rows past the
        base logged at an LSN ``upto`` says (``"<= 12"``)."""
        with self._lock:
            base = self._base
            tail_rows, tail_bytes = self._tail_rows, self._tail_bytes
        logged = f"{LSN_COLUMN} {upto}"
        if base is not None:
            logged += f" AND {LSN_COLUMN} > {base.meta.lsn}"
        return (
            base,
            tail_rows,
            tail_bytes,
            f"SELECT * EXCLUDE ({LSN_COLUMN}) FROM {self.tail} WHERE {logged}",
        )

    def write_checkpoint(self, path: str, lsn: int) -> tuple[int, int, int, int]:
        """The base's file copied to ``path`` with the tail's rows up to ``lsn`` added;
        its (rows, digest, Arrow bytes): the base's (kept in its record) plus the added
        rows' (hashed here: only they are read), and the rows deleted in place the copy
        still holds. A base holding many of those (:func:`_mostly_dead`) is not copied: its
        rows are written again whole, and their slots go (compaction, in the background as
        every checkpoint)."""
        base, tail_rows, tail_bytes, added = self._logged(f"<= {int(lsn)}")
        rows, digest = self.engine.checksum(added)
        compact = base is not None and _mostly_dead(base.meta.rows, base.meta.dead)
        copied = base is not None and not compact and _copy_file(base.path, path)
        if base is not None and not copied:  # compacted, or its file is gone (another copy of
            # the shard checkpointed since): the rows are written again, from the file open here
            added = f"SELECT * FROM {base.table} UNION ALL {added}"
        name = f"{self.physical}_ckpt{next(_DATABASES)}"
        self.engine.attach_file(name, path)
        try:
            if copied:
                self.engine.execute(f"INSERT INTO {quote(name)}.main.{SHARD_TABLE} {added}")
            else:
                self.engine.execute(f"CREATE TABLE {quote(name)}.main.{SHARD_TABLE} AS {added}")
            self._seal(name, lsn, fresh=not copied)
        finally:
            self.engine.detach(name)
        nbytes = tail_bytes * rows // tail_rows if tail_rows else 0
        if base is not None:
            rows, digest, nbytes = (
                rows + base.meta.rows,
                digest + base.meta.digest,
                nbytes + base.meta.nbytes,
            )
        return rows, digest, nbytes, base.meta.dead if copied and base is not None else 0

    def write_change(
        self,
        path: str,
        lsn: int,
        change: RowRewrite,
        keeps: Callable[[pa.Table], np.ndarray] | None = None,
    ) -> Written:
        """The rows logged before ``lsn`` as ``change`` leaves them, written as a new
        checkpoint file at ``path`` (at ``lsn``); its (rows, digest, Arrow bytes) and the
        rows changed. Where none is, nothing is written. A change of a few rows copies the
        base's file (a file copy, at disk speed), adds the tail's rows and runs the change
        in the copy (DuckDB keeps deleted rows' slots until it vacuums them); one of many
        (:data:`REWRITE_SHARE`) writes the rows again whole, reclaiming what deletes left.
        Values that do not fit their column fail as DuckDB says (a ``duckdb.Error``), and
        so does a NULL set in a column that takes none. An UPDATE of the key (``change.key``)
        is a delete of the rows it changes and an insert of those whose new key ``keeps``
        holds here; the others are answered (``Written.leaving``), for their new shards."""
        base, tail_rows, tail_bytes, added = self._logged(f"< {int(lsn)}")
        rows_then = f"SELECT * FROM {base.table} UNION ALL {added}" if base is not None else added
        alias = quote(change.alias)
        matched = f"({change.where})" if change.where else "true"
        found = self.engine.run(
            f"SELECT count(*) AS n FROM ({rows_then}) AS {alias} WHERE {matched}", change.inputs
        )
        changed = int(found.column("n")[0].as_py())
        if not changed:
            return Written(0, 0, 0, changed)
        returned: pa.Table | None = None
        staying: pa.Table | None = None
        leaving: pa.Table | None = None
        if change.delete and change.returning is not None:
            returned = self.engine.run(
                returning_query(f"({rows_then})", change.alias, change.where, (), change.returning),
                change.inputs,
            )
        elif change.key is not None or change.returning is not None:
            # new values first: rows may leave (deleted here, inserted where they belong),
            # or what is returned must be what is stored (a volatile SET evaluated once)
            sets = change.typed_sets or change.sets  # typed by the session
            updated = self.engine.run(
                returning_query(f"({rows_then})", change.alias, change.where, sets, "*"),
                change.inputs,
            )
            updated = (
                updated.cast(self.schema) if not updated.schema.equals(self.schema) else updated
            )
            for column, _ in change.sets:
                if not self.schema.field(column).nullable and updated.column(column).null_count:
                    raise SchemaMismatchError(
                        f"column {column!r} takes no NULL: the UPDATE would set it in "
                        f"{updated.column(column).null_count} row(s); nothing was changed"
                    )
            if change.returning is not None:
                returned = self.engine.run(
                    returning_query("__sf_rows", change.alias, None, (), change.returning),
                    {**change.inputs, "__sf_rows": updated},
                )
            if change.key is not None:
                assert keeps is not None, "an UPDATE of the key needs to know what stays"
                kept = np.asarray(keeps(updated))
                staying = updated.filter(pa.array(kept))
                leaving = updated.filter(pa.array(~kept))
            else:
                staying = updated
            change = dataclasses.replace(change, sets=(), delete=True, key=None)
        before = tail_rows + (base.meta.rows if base is not None else 0)
        weight = tail_bytes + (base.meta.nbytes if base is not None else 0)
        name = f"{self.physical}_prep{next(_DATABASES)}"
        table = f"{quote(name)}.main.{SHARD_TABLE}"
        dead = base.meta.dead if base is not None else 0
        whole = base is None or _mostly_dead(before - changed, dead + changed)
        copied = not whole and base is not None and _copy_file(base.path, path)
        self.engine.attach_file(name, path)
        try:
            if copied:
                assert base is not None
                rows, digest = self.engine.checksum(added)
                self.engine.execute(f"INSERT INTO {table} {added}")
                rows, digest = self._change_in_place(
                    name, change, changed, rows + base.meta.rows, digest + base.meta.digest
                )
            else:
                self._write_changed(table, rows_then, change)
                rows, digest = self.engine.checksum(f"SELECT * FROM {table}")
            if staying is not None and staying.num_rows:
                self.engine.execute(
                    f"INSERT INTO {table} SELECT * FROM __sf_rows", {"__sf_rows": staying}
                )
                more, more_digest = self.engine.checksum(
                    "SELECT * FROM __sf_rows", {"__sf_rows": staying}
                )
                rows, digest = rows + more, digest + more_digest
            self._refuse_nulls(table, [column for column, _ in change.sets])
            self._seal(name, lsn, fresh=not copied)
        finally:
            self.engine.detach(name)
        if copied and change.delete:
            dead += changed  # their slots stay in the copy until it is written whole
        nbytes = weight * rows // before if before else 0
        return Written(rows, digest, nbytes, changed, leaving, dead if copied else 0, returned)

    def _write_changed(self, table: str, rows_then: str, change: RowRewrite) -> None:
        """Write ``rows_then`` as ``change`` leaves them, whole, as ``table``: the rows kept
        (a DELETE), or every row and then the UPDATE run over them (values cast to their
        columns as DuckDB's own UPDATE casts them)."""
        source = f"({rows_then}) AS {quote(change.alias)}"
        kept = f"NOT coalesce(({change.where}), false)" if change.where else "false"
        # the shard's column types, whatever the expressions' are
        self.engine.execute(f"CREATE TABLE {table} AS SELECT * FROM {source} LIMIT 0")
        if change.delete:
            self.engine.execute(
                f"INSERT INTO {table} SELECT * FROM {source} WHERE {kept}", change.inputs
            )
            return
        self.engine.execute(f"INSERT INTO {table} SELECT * FROM {source}")
        sets = ", ".join(f"{quote(column)} = ({value})" for column, value in change.sets)
        matched = f"({change.where})" if change.where else "true"
        target = f"{table} AS {quote(change.alias)}"
        self.engine.execute(f"UPDATE {target} SET {sets} WHERE {matched}", change.inputs)

    def _change_in_place(
        self, name: str, change: RowRewrite, changed: int, rows: int, digest: int
    ) -> tuple[int, int]:
        """Run ``change`` in the copied file's table; its (rows, digest) after, from those
        before: the changed rows' hashes taken out, an UPDATE's new ones put in (hashed by
        row id; where DuckDB moved them, the table is hashed whole)."""
        table = f"{quote(name)}.main.{SHARD_TABLE}"
        target = f"{table} AS {quote(change.alias)}"
        matched = f"({change.where})" if change.where else "true"
        _, old = self.engine.checksum(f"SELECT * FROM {target} WHERE {matched}", change.inputs)
        if change.delete:
            self.engine.execute(f"DELETE FROM {target} WHERE {matched}", change.inputs)
            return rows - changed, digest - old
        ids = f"{quote(name)}.main.{CHANGED_ROWS}"
        self.engine.execute(
            f"CREATE TABLE {ids} AS SELECT rowid AS r FROM {target} WHERE {matched}",
            change.inputs,
        )
        sets = ", ".join(f"{quote(column)} = ({expression})" for column, expression in change.sets)
        self.engine.execute(f"UPDATE {target} SET {sets} WHERE {matched}", change.inputs)
        count, new = self.engine.checksum(
            f"SELECT * FROM {table} WHERE rowid IN (SELECT r FROM {ids})"
        )
        self.engine.execute(f"DROP TABLE {ids}")
        if count != changed:
            return self.engine.checksum(f"SELECT * FROM {table}")
        return rows, digest - old + new

    def _refuse_nulls(self, table: str, columns: list[str]) -> None:
        """``SchemaMismatchError`` where one of ``columns`` that takes no NULL holds one."""
        for column in columns:
            field = self.schema.field(column)
            if field.nullable:
                continue
            found = self.engine.run(
                f"SELECT count(*) AS n FROM {table} WHERE {quote(column)} IS NULL"
            ).column("n")[0]
            if found.as_py():
                raise SchemaMismatchError(
                    f"column {column!r} takes no NULL: the UPDATE would set it in "
                    f"{found.as_py()} row(s); nothing was changed"
                )

    def _seal(self, name: str, lsn: int, *, fresh: bool) -> None:
        """Finish a checkpoint file being written: its index (a new file's), the LSN it
        holds the rows up to (recovery checks it against its name), written to disk."""
        table = f"{quote(name)}.main.{SHARD_TABLE}"
        if fresh and self.index is not None:
            self.engine.execute(f"CREATE INDEX {KEY_INDEX} ON {table} ({quote(self.index)})")
        marker = f"{quote(name)}.main.{CHECKPOINT_TABLE}"
        self.engine.execute(f"CREATE OR REPLACE TABLE {marker} AS SELECT {int(lsn)}::BIGINT AS lsn")
        for attempt in range(SEAL_ATTEMPTS):
            try:
                self.engine.execute(f"CHECKPOINT {quote(name)}")
                return
            except duckdb.TransactionException:  # DuckDB refuses it while another write
                # transaction is active (seen once in a bank run): it ends in milliseconds
                if attempt == SEAL_ATTEMPTS - 1:
                    raise
                time.sleep(CLOSE_RETRY_S * (attempt + 1))

    def use_checkpoint(self, path: str, meta: CheckpointMeta) -> None:
        """Read the rows up to ``meta.lsn`` from the checkpoint file at ``path`` from now
        on: the view switches to it and the tail drops them, in one transaction (a reader
        sees the one or the other; one that pinned a snapshot keeps its own)."""
        base = self._attach(path, meta)
        with self._lock:
            old = self._base
            self._base = base
            statements = [
                self._view_sql(),
                f"DELETE FROM {self.tail} WHERE {LSN_COLUMN} <= {int(meta.lsn)}",
            ]
            self.engine.execute_in_transaction(statements)
            left = self.engine.run(f"SELECT count(*) AS n FROM {self.tail}").column("n")[0]
            left_rows = int(left.as_py())
            if self._tail_rows:
                self._tail_bytes = self._tail_bytes * left_rows // self._tail_rows
            self._tail_rows = left_rows
        self._retire(old)
        self.engine.compactor.settle(self.physical)  # the dropped rows' memory goes

    def _retire(self, old: _Base | None) -> None:
        """Stop reading an older base; it is detached at the next switch, not now: a
        statement that began before this one switched may still bind the view it read."""
        with self._lock:
            gone, self._retired = self._retired, old
        if gone is not None:
            self._detach(gone)

    def _detach(self, base: _Base) -> None:
        """Detach a base; a copy of it made in the local folder (the data directory is not
        local) goes with it."""
        self.engine.detach(base.name)
        if self._copied(base):
            with contextlib.suppress(OSError):
                os.unlink(base.path)

    def _attach(self, path: str, meta: CheckpointMeta) -> _Base:
        """Attach a checkpoint file read-only, refusing one that is not what ``meta`` says
        (another LSN: a stale file under a newer name; other row counts: a damaged one)."""
        name = f"{self.physical}_base{next(_DATABASES)}"
        try:
            self.engine.attach_file(name, path, read_only=True)
        except duckdb.Error as error:
            if not os.path.exists(path):  # superseded since it was listed: list again
                raise FileNotFoundError(path) from None
            raise StorageError(f"checkpoint {path} cannot be opened: {error}") from None
        try:
            found = self.engine.run(
                f"SELECT (SELECT max(lsn) FROM {quote(name)}.main.{CHECKPOINT_TABLE}) AS lsn, "
                f"(SELECT count(*) FROM {quote(name)}.main.{SHARD_TABLE}) AS n"
            ).to_pylist()[0]
        except duckdb.Error as error:
            self.engine.detach(name)
            raise StorageError(f"checkpoint {path} is damaged: {error}") from None
        if found["lsn"] != meta.lsn or found["n"] != meta.rows:
            self.engine.detach(name)
            raise StorageError(
                f"checkpoint {path} holds {found['n']} rows up to LSN {found['lsn']}, its "
                f"record {meta.rows} up to {meta.lsn}: a stale or damaged file, not served"
            )
        return _Base(name, path, meta)

    # -- reads ---------------------------------------------------------------------------
    def indexed(self) -> bool:
        """Whether the table has its index (as DuckDB says; none is asked for without one)."""
        return self.index is not None and self.physical in self.engine.indexed_databases()

    def read(self) -> pa.Table:
        table = self.engine.run(f"SELECT * FROM {self.ref}")
        return table.cast(self.schema) if not table.schema.equals(self.schema) else table

    def stream(self, batch_rows: int) -> RowStream:
        """Exactly the rows there are now, read a batch at a time however many appends
        follow (a transaction begun now keeps seeing them)."""
        with self._lock:
            cursor = self.engine._database.cursor()
            cursor.execute("BEGIN TRANSACTION")
            # the snapshot begins when the transaction first reads: the base's database
            # too, which then stays readable to it after a switch detaches it
            cursor.execute(f"SELECT count(*) FROM {self.tail}").fetchall()
            cursor.execute(f"SELECT * FROM {self.ref} LIMIT 0").fetchall()
            base = self._base
        tail = f"SELECT * EXCLUDE ({LSN_COLUMN}) FROM {self.tail}"
        known = (base.meta.rows, base.meta.digest) if base is not None else (0, 0)
        return RowStream(cursor, f"SELECT * FROM {self.ref}", batch_rows, self.schema, tail, known)

    def checksum(self) -> tuple[int, int]:
        """(rows, order-independent sum of row hashes) of every row, hashed here (the
        base's too: what VERIFY compares with the rows a move's source handed out)."""
        return self.engine.checksum(f"SELECT * FROM {self.ref}")

    def checksum_in_steps(
        self, step_rows: int, after_step: Callable[[int, float], None]
    ) -> tuple[int, int]:
        """:meth:`checksum` of a shard nothing changes meanwhile (a move's copy before it
        is served). A base read where it lies in the data directory is the very file the
        source's pinned checksum names: its record's sums stand for it (its LSN and row
        count were checked when it was attached, and DuckDB checks every block's own
        checksum as it reads it). A base copied here from elsewhere is hashed
        ``step_rows`` rows at a time (by row id: a checkpoint file's rows are numbered
        without gaps); ``after_step(bytes, seconds)`` follows each step (a move paces
        itself there)."""
        with self._lock:
            base = self._base
        rows, digest = self.engine.checksum(f"SELECT * EXCLUDE ({LSN_COLUMN}) FROM {self.tail}")
        if base is None:
            return rows, digest
        if not self._copied(base):
            return rows + base.meta.rows, digest + base.meta.digest
        row_bytes = base.meta.nbytes / max(base.meta.rows, 1)
        for low in range(0, max(base.meta.rows, 1), step_rows):
            high = "" if low + step_rows >= base.meta.rows else f" AND rowid < {low + step_rows}"
            started = time.monotonic()
            count, part = self.engine.checksum(
                f"SELECT * FROM {base.table} WHERE rowid >= {low}{high}"
            )
            rows, digest = rows + count, digest + part
            after_step(int(count * row_bytes), time.monotonic() - started)
        return rows, digest

    def _copied(self, base: _Base) -> bool:
        """Whether ``base`` is a copy made in the local folder (the data directory is not
        local), not the file itself."""
        return os.path.dirname(os.path.abspath(base.path)) == os.path.abspath(self.scratch)

    @property
    def rows(self) -> int:
        with self._lock:  # a switch changes the base and the tail together
            base = self._base
            return self._tail_rows + (base.meta.rows if base is not None else 0)

    @property
    def nbytes(self) -> int:
        """Arrow size of the rows (DuckDB keeps them compressed, usually smaller)."""
        with self._lock:
            base = self._base
            return self._tail_bytes + (base.meta.nbytes if base is not None else 0)

    @property
    def checkpoint_lsn(self) -> int | None:
        """The LSN of the checkpoint file read as the base (None: none)."""
        base = self._base
        return base.meta.lsn if base is not None else None

    def compact(self) -> None:
        """Compress the tail's rows now, on this thread (appends to the shard wait)."""
        self.engine.compactor.compact(self.physical)

    def settle(self) -> None:
        """Compress the tail's rows soon, on the compactor's thread (:meth:`Compactor.settle`)."""
        self.engine.compactor.settle(self.physical)

    def drop(self) -> None:
        self.abandon_load()
        with self._lock:
            bases, self._base, self._retired = (self._base, self._retired), None, None
        self.engine.detach(self.physical)
        for base in bases:
            if base is not None:
                self._detach(base)

    # -- the test-only fault hook ----------------------------------------------------------
    def corrupt_for_test(self, fault: str) -> None:
        """Make the shard hold something else than it was given (tests of VERIFY only):
        one row fewer ("drop_row") or one value changed ("change_value"). The base's file
        is read-only: its rows go into the tail first, and the tail is changed."""
        with self._lock:
            base = self._base
            if base is not None:
                self.engine.execute(
                    f"INSERT INTO {self.tail} SELECT *, {base.meta.lsn}::BIGINT FROM {base.table}"
                )
                self._base = None
                self._tail_rows += base.meta.rows
                self._tail_bytes += base.meta.nbytes
                self.engine.execute(self._view_sql())
        self._retire(base)
        where = "rowid = (SELECT min(rowid) FROM {table}{condition})"
        if fault == "drop_row":
            first = where.format(table=self.tail, condition="")
            self.engine.execute(f"DELETE FROM {self.tail} WHERE {first}")
        else:
            column, changed = _column_to_change(self.schema)
            first = where.format(table=self.tail, condition=f" WHERE {column} IS NOT NULL")
            self.engine.execute(f"UPDATE {self.tail} SET {column} = {changed} WHERE {first}")


def _copy_file(source: str, target: str) -> bool:
    """Copy a file (False: it is gone)."""
    try:
        shutil.copyfile(source, target)
    except FileNotFoundError:
        return False
    return True


def _column_to_change(schema: pa.Schema) -> tuple[str, str]:
    """A column of ``schema`` and an expression that changes its (non-NULL) value."""
    for field_ in schema:
        column = quote(field_.name)
        kind = field_.type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
            return column, f"{column} + 1"
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return column, f"{column} || '~'"
    column = quote(schema[0].name)
    return column, "NULL"


class RowStream:
    """A pinned snapshot read in batches; safe to pull from several threads (each batch is
    handed out once, in whatever order)."""

    def __init__(
        self,
        cursor: duckdb.DuckDBPyConnection,
        select: str,
        batch_rows: int,
        schema: pa.Schema,
        hashed: str | None = None,
        known: tuple[int, int] = (0, 0),
    ) -> None:
        """``hashed`` and ``known``: the snapshot's checksum is that of the rows
        ``hashed`` selects plus ``known`` (a base's, kept in its record); without
        ``hashed``, that of ``select``."""
        self._cursor = cursor
        self._select = select
        self._batch_rows = batch_rows
        self._schema = schema
        self._hashed = hashed or select
        self._known = known
        self._reader: pa.RecordBatchReader | None = None
        self._lock = threading.Lock()
        self._closed = False

    def next(self) -> pa.Table | None:
        """The next batch, or None when every row was handed out (the stream then closes)."""
        with self._lock:
            if self._closed:
                return None
            if self._reader is None:
                self._reader = self._cursor.sql(self._select).to_arrow_reader(self._batch_rows)
            try:
                batch = self._reader.read_next_batch()
            except StopIteration:
                self._close_locked()
                return None
        table = pa.Table.from_batches([batch])
        return table.cast(self._schema) if not table.schema.equals(self._schema) else table

    def checksum(self) -> tuple[int, int] | None:
        """(rows, sum of row hashes) of the whole snapshot, hashed where it is stored (a
        third of hashing the batches as Arrow), or None once reading has begun."""
        with self._lock:
            if self._closed or self._reader is not None:
                return None
            ((rows, digest),) = self._cursor.execute(checksum_sql(self._hashed)).fetchall()
        return int(rows) + self._known[0], int(digest) + self._known[1]

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if self._reader is not None:  # handed out in part (the move rolled back)
                    self._reader.close()
                self._cursor.execute("COMMIT")
            except duckdb.ConnectionException:
                pass  # the engine closed (its worker stopped): the snapshot went with it
            finally:
                self._cursor.close()


class Compactor:
    """Compresses the rows appended to an engine's native tables, on a thread of its own.

    DuckDB keeps appended rows uncompressed until a checkpoint compresses them (one unit of
    TPC-H lineitem: 495 MB as appended, 91 MB compressed). Left to itself it checkpoints
    inside whichever commit crosses its ``checkpoint_threshold``, and a checkpoint blocks
    appends to the database it writes: an INSERT, a user's or a live move's, waited 2-6 s
    while every new row group was compressed. The engine turns that off; each shard has a
    database of its own (:class:`NativeRows`), and this thread checkpoints one once
    ``after_bytes`` were appended to it, so only that shard's appends wait, for as long
    as its own new rows take. Bulk work holds a database back (:meth:`hold`: a load while
    it stages, a move's copy until it is served), for at most :data:`DEFER_AT_MOST_S`."""

    def __init__(
        self,
        database: duckdb.DuckDBPyConnection,
        after_bytes: int,
        spill_folder: str | None = None,
    ) -> None:
        self._database = database
        self.after_bytes = after_bytes
        self._spill_folder = spill_folder
        self._pending: dict[str, int] = {}
        """Bytes appended since the last checkpoint, per database."""
        self._holds: dict[int, tuple[frozenset[str], float]] = {}
        self._next_hold = 0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.runs = 0
        """Checkpoints done (for tests and logs)."""

    def appended(self, database: str, nbytes: int) -> None:
        with self._changed:
            self._pending[database] = self._pending.get(database, 0) + nbytes
            if self._pending[database] >= self.after_bytes:
                self._start_locked()
                self._changed.notify_all()

    def settle(self, database: str) -> None:
        """Compress what was appended to ``database`` soon, however little (its bulk work
        ended: a load's last rows would otherwise stay uncompressed until more come)."""
        with self._changed:
            if self._pending.get(database):
                self._pending[database] = max(self._pending[database], self.after_bytes)
                self._start_locked()
                self._changed.notify_all()

    def forget(self, database: str) -> None:
        """The database is gone."""
        with self._changed:
            self._pending.pop(database, None)

    def hold(self, databases: Iterable[str]) -> Callable[[], None]:
        """Hold compaction of ``databases`` back until the returned function is called
        (once is enough)."""
        with self._changed:
            self._next_hold += 1
            token = self._next_hold
            self._holds[token] = (frozenset(databases), time.monotonic())

        def release() -> None:
            with self._changed:
                if self._holds.pop(token, None) is not None:
                    self._changed.notify_all()

        return release

    @property
    def held(self) -> int:
        """Holds not released yet."""
        with self._changed:
            return len(self._holds)

    def compact(self, database: str) -> None:
        """Checkpoint ``database`` now, on this thread."""
        with self._changed:
            self._pending.pop(database, None)
        self._checkpoint(database)

    def close(self) -> None:
        """Stop; a checkpoint under way is waited for (at most COMPACTOR_CLOSE_WAIT_S)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(COMPACTOR_CLOSE_WAIT_S)

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="compactor", daemon=True)
            self._thread.start()

    def _next_locked(self) -> tuple[str | None, float | None]:
        """The database to checkpoint now (the one with most new bytes), else the seconds
        until a hold keeping one back expires (None: nothing is due)."""
        now = time.monotonic()
        held: dict[str, float] = {}
        for databases, since in self._holds.values():
            for name in databases:
                held[name] = min(held.get(name, since), since)
        wait: float | None = None
        for name, pending in sorted(self._pending.items(), key=lambda item: -item[1]):
            if pending < self.after_bytes:
                break
            expires = held.get(name, -DEFER_AT_MOST_S) + DEFER_AT_MOST_S
            if expires <= now:
                return name, None
            wait = expires - now if wait is None else min(wait, expires - now)
        return None, wait

    def _run(self) -> None:
        while True:
            with self._changed:
                database, wait = self._next_locked()
                while not self._closed and database is None:
                    self._changed.wait(wait)
                    database, wait = self._next_locked()
                if self._closed or database is None:
                    return
                del self._pending[database]
            self._checkpoint(database)

    def _room_to_compact(self) -> bool:
        """Whether the spill folder's disk has :data:`COMPACT_ROOM_BYTES` free: a checkpoint
        that cannot offload a block there invalidates the shard's in-memory database, which
        then serves nothing until the worker restarts (seen with a full spill disk)."""
        if self._spill_folder is None:
            return True
        folder = os.path.abspath(self._spill_folder)
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)  # DuckDB makes the folder when it first spills
        try:
            return shutil.disk_usage(folder).free >= COMPACT_ROOM_BYTES
        except OSError:
            return True

    def _checkpoint(self, database: str) -> None:
        if not self._room_to_compact():  # its new rows stay as they are, uncompressed
            log.info("compaction of %s skipped: the spill folder's disk is nearly full", database)
            return
        started = time.monotonic()
        try:
            cursor = self._database.cursor()
            try:
                cursor.execute(f"CHECKPOINT {quote(database)}")
            finally:
                cursor.close()
        except duckdb.Error as error:  # gone meanwhile; or its rows stay as they are
            log.info("compaction of %s skipped: %s", database, error)
            return
        self.runs += 1
        log.debug("compacted %s in %.2f s", database, time.monotonic() - started)


COMPACT_ROOM_BYTES = 64 << 20
"""Free space a compaction wants on the spill folder's disk (see ``_room_to_compact``)."""


def query_error(error: duckdb.Error) -> QueryError:
    """DuckDB's error as shardflow's: a refusal of the SQL itself (parser, binder, catalog)
    is a :class:`StageRefused`, any other (a value that does not convert, an overflow) a
    :class:`QueryError`; DuckDB's message is kept."""
    message = str(error).strip()
    if "required statistics" in message:  # e.g. BITSTRING_AGG(col) without its min and max
        return UnsupportedError(
            "the query needs column statistics (a minimum and a maximum) that DuckDB keeps "
            f"for its own tables and shardflow's tables do not carry: {message}"
        )
    refused = (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException)
    kind = StageRefused if isinstance(error, refused) else QueryError
    return kind(message)


def as_schema(result: pa.Table, schema: pa.Schema) -> pa.Table:
    """The answer with DuckDB's column names, and its types where they convert safely."""
    if result.num_columns != len(schema):
        raise AssertionError(f"plan produced {result.num_columns} columns, query has {len(schema)}")
    result = result.rename_columns(schema.names)
    if result.schema.equals(schema):
        return result
    try:
        return result.cast(schema, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return result


def distinct_names(result: pa.Table) -> pa.Table:
    """``result`` with repeated column names told apart (``x``, ``x_1``), as Arrow tables
    with repeated names cannot be shipped. Only a query run as written can repeat a name
    (the planner names every other stage's outputs uniquely), and its answer is named by
    position after DuckDB's schema on the client."""
    names = result.column_names
    if len(set(names)) == len(names):
        return result
    seen: set[str] = set()
    unique = []
    for name in names:
        candidate, n = name, 0
        while candidate in seen:
            n += 1
            candidate = f"{name}_{n}"
        seen.add(candidate)
        unique.append(candidate)
    return result.rename_columns(unique)


class PartsGiven:
    """A fragment's result given in parts (a worker's ``execute(emit=...)``): each part,
    its repeated column names told apart, to ``emit``; the rows and bytes given."""

    def __init__(self, emit: Callable[[pa.Table], None]) -> None:
        self.emit = emit
        self.rows = self.bytes = 0

    def __call__(self, part: pa.Table) -> None:
        part = distinct_names(part)
        self.rows += part.num_rows
        self.bytes += part.nbytes
        self.emit(part)
