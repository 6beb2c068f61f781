"""Run sqllogictest files against shardflow with a live DuckDB as the oracle.

For each file, and for each table layout (see :mod:`tests.conformance.layouts`), the runner
replays the file's records in order in a fresh in-memory DuckDB (the version the project
pins). Before a ``query`` it brings shardflow's copy of every DuckDB table up to date
(tables whose schema, row count or content hash changed are dropped and loaded again, read
out of DuckDB as Arrow), runs the query in DuckDB and in shardflow, and compares the two
answers. Every query ends as exactly one of:

* ``equal`` -- the same answer (see :func:`compare`);
* ``unsupported`` -- shardflow raised :class:`shardflow.UnsupportedError`;
* ``wrong`` -- a different answer, or any other exception;
* ``skipped`` -- by a named rule (:data:`RULES` documents each), counted per rule.

The last line printed is ``conformance: N/M equal, U unsupported, W wrong, S skipped``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import sqlglot
from sqlglot import exp

from shardflow.catalog.types import storage_schema
from tests.conformance.analysis import (
    CATALOG_FUNCTIONS,
    QUERY_KEYWORDS,
    READ_ONLY_KEYWORDS,
    QueryFacts,
    analyze,
    first_keyword,
    outer_query,
    with_null_order,
    without_limit,
)
from tests.conformance.backends import Backend, QueryTimeout
from tests.conformance.layouts import FIRST_COLUMN, LayoutPlan, plan_layouts
from tests.conformance.slt import Command, Query, Record, SltParseError, Statement, expand, parse
from tests.support.oracle import (
    assert_limited_result,
    assert_same_result,
    assert_same_values,
    sort_key_indexes,
)

__all__ = [
    "RULES",
    "Case",
    "Report",
    "compare",
    "corpus_dir",
    "run_files",
    "sample_files",
]

EQUAL, UNSUPPORTED, WRONG, SKIPPED = "equal", "unsupported", "wrong", "skipped"

RULES: dict[str, str] = {
    # whole files
    "unparsable file": "the file is not well-formed sqllogictest; its `query` lines count",
    "require": "`require X` that this DuckDB build does not meet (extensions not built in, "
    "other vector sizes, ...)",
    "statement DuckDB refuses": "a DELETE or UPDATE DuckDB refuses (a constraint; shardflow "
    "keeps none) or answers no count of: not run in shardflow",
    "table not held": "a DELETE or UPDATE of a table shardflow does not hold (see the load "
    "rules), or one that reads such a table or a view",
    "UPDATE ... FROM counts matches": "an UPDATE ... FROM whose rows several rows of the other "
    "tables match: DuckDB's count is the matches, shardflow's the rows changed (each once, "
    "as DuckDB changes them); the queries after it compare the rows",
    "persistent database": "`load`, `restart`, `reconnect` or `unzip`: the file needs a "
    "database file or a restart, which the in-memory oracle cannot replay",
    "include": "`include` of a template file that is not in the corpus",
    "require-env": "`require-env`: an environment the file needs",
    # records
    "mode skip": "between `mode skip` and `mode unskip`",
    "halt": "after `halt`",
    "skipif/onlyif": "`skipif duckdb` or `onlyif <other engine>`",
    "not a SELECT": "a `query` record that is not a query (DESCRIBE, EXPLAIN, SUMMARIZE, "
    "PRAGMA, SHOW, CALL, INSERT ... RETURNING, ...; a DELETE or UPDATE ... RETURNING is "
    "compared where the row changes are)",
    "duckdb error": "DuckDB itself does not answer the query",
    "external data file": "reads files (read_csv/read_parquet/..., data/ paths, COPY output)",
    "duckdb timeout": "DuckDB did not answer within ORACLE_TIMEOUT_S (60 s)",
    "catalog table function": "pragma_*, duckdb_*, histogram_values(), query_table(), ...: "
    "they read DuckDB's catalog or a table by name",
    "volatile function": "random(), uuid(), now(), nextval(), reservoir_quantile(), ...: two "
    "evaluations (or two row orders) differ",
    "sample": "USING SAMPLE / TABLESAMPLE draws rows at random",
    "qualified table name": "a schema- or catalog-qualified table (shardflow tables have "
    "no schema)",
    "view": "reads a view (shardflow has no views)",
    "macro": "calls a macro created by the file",
    "session variable": "getvariable(): SET VARIABLE lives in the DuckDB session",
    "setting": "a DuckDB setting that changes answers differs from its default "
    "(default_order, collations, ...); for default_null_order the query goes to shardflow "
    "with its NULLS FIRST/LAST written out, where DuckDB answers that text under its "
    "default the same, and skips otherwise",
    "search path": "USE or search_path moved name resolution away from memory.main",
    "unknown relation": "reads a relation that is not a DuckDB table of memory.main/temp",
    "type changes through Arrow": "a table read has a type that DuckDB's Arrow export does "
    "not keep (HUGEINT, ENUM, UUID, BIT, ...): its copy would not be the same data",
    "collated column (Arrow columns carry no collation)": "a table read has a column "
    "declared with COLLATE (NOCASE, ...); shardflow's tables are Arrow data, which compares "
    "strings byte by byte, so its copy would not compare the same",
    "shardflow cannot store the table": "create_table refused the table",
    "table function refused": "shardflow raised UnsupportedError for a query over a table "
    "function (range, generate_series, unnest, ...)",
    "cluster hung earlier in the file": "shardflow gave no answer twice in this file and "
    "layout (each a wrong case); its other queries there are not run",
    "order-dependent answer": "the answers differ, and DuckDB's own answer changes when the "
    "tables' rows are stored in another order or scanned from Arrow chunks by several "
    "threads (list() without ORDER BY, LIMIT in a subquery, ties in ROW_NUMBER, "
    "arg_min_nulls_last(), ...), and shardflow's answer is none of DuckDB's",
}

# DuckDB settings that do not change answers; any other setting that differs from a fresh
# connection's value makes the queries after it skip by rule "setting".
HARMLESS_SETTINGS = frozenset(
    {
        "threads",
        "worker_threads",
        "memory_limit",
        "max_memory",
        "temp_directory",
        "max_temp_directory_size",
        "operator_memory_limit",
        "profiling_mode",
        "profiling_output",
        "profile_output",
        "enable_profiling",
        "custom_profiling_settings",
        "profiling_renderer_settings",
        "enable_progress_bar",
        "enable_progress_bar_print",
        "progress_bar_time",
        "explain_output",
        "disabled_optimizers",
        "enable_optimizer",
        "merge_join_threshold",
        "nested_loop_join_threshold",
        "asof_loop_join_threshold",
        "prefer_range_joins",
        "perfect_ht_threshold",
        "enable_caching_operators",
        "delim_join_as_cte",
        "pivot_filter_threshold",
        "dynamic_or_filter_threshold",
        "approximate_join_order_threshold",
        "late_materialization_max_rows",
        "wal_autocheckpoint",
        "checkpoint_threshold",
        "force_compression",
        "storage_compatibility_version",
        "max_execution_time",
        "enable_view_dependencies",
        "preserve_insertion_order",
        "enable_verification",
        "verify_parallelism",
        "verify_external",
        "verify_serializer",
        "debug_force_external",
        "debug_force_no_cross_product",
        "debug_window_mode",
        "debug_asof_iejoin",
        "debug_verify_vector",
        "debug_verify_serializer",
        "debug_verify_column_bindings",
        "debug_checkpoint_abort",
        "disable_checkpoint_on_shutdown",
        "force_parallelism",
        "enable_object_cache",
        "seed",
        "write_buffer_row_group_memory_limit",
        "enabled_log_types",
        "disabled_log_types",
        "enable_logging",
        "logging_level",
        "logging_mode",
        "logging_storage",
    }
)

NULL_ORDER = "default_null_order"
QUERY_NODES = (exp.Query, exp.Pivot, exp.Values)
REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS_ENV = "SHARDFLOW_PEER_SQL"
_DUCKDB_VECTOR_SIZE = 2048  # the Python package's STANDARD_VECTOR_SIZE
_MET_REQUIREMENTS = frozenset({"no_alternative_verify", "skip_reload", "64bit", "noforcestorage"})
MAX_TIMEOUTS_PER_PASS = 2
"""After this many shardflow queries without an answer, a file's pass stops asking."""
ORACLE_TIMEOUT_S = 60.0
"""DuckDB queries running longer are interrupted (and skip by rule "duckdb error")."""
FULL_ANSWER_ROWS = 1_000_000
"""A LIMIT query's answer without the LIMIT is not used beyond this many rows."""
SAMPLE_EVERY = 16
"""The fast sample: every 16th file of the sorted corpus from the first (37 of 584 files,
all 13 categories, about a minute on this 2-core machine)."""


def corpus_dir() -> Path | None:
    """``$SHARDFLOW_PEER_SQL`` or ``../shared/peer-sql/duckdb/test/sql`` beside the
    repository; None where it is absent."""
    configured = os.environ.get(CORPUS_ENV)
    path = Path(configured) if configured else REPO_ROOT.parent / "shared/peer-sql/duckdb/test/sql"
    return path if path.is_dir() else None


DML_CORPUS_ENV = "SHARDFLOW_PEER_SQL_DML"


def dml_corpus_dir() -> Path | None:
    """DuckDB's tests of row changes: ``$SHARDFLOW_PEER_SQL_DML`` or
    ``../shared/peer-sql/duckdb-dml/test/sql`` beside the repository; None where absent."""
    configured = os.environ.get(DML_CORPUS_ENV)
    default = REPO_ROOT.parent / "shared/peer-sql/duckdb-dml/test/sql"
    path = Path(configured) if configured else default
    return path if path.is_dir() else None


def list_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.test"), key=lambda p: p.relative_to(root).as_posix())


def sample_files(files: Sequence[Path], every: int = SAMPLE_EVERY) -> list[Path]:
    return list(files[::every])


DML_SLOW = ("update/test_stress_update_issue_19688.test",)
"""DML files too slow for the sample (a stress loop of thousands of statements: 3 minutes)."""


def dml_sample(files: Sequence[Path]) -> list[Path]:
    """The fast sample of the DML corpus: every other file, the slow ones left out."""
    return [f for f in files[::2] if not any(f.as_posix().endswith(s) for s in DML_SLOW)]


# --------------------------------------------------------------------------------------
# results


@dataclass
class Case:
    """One query in one layout (or a skip, once per query where the rule is not about a
    layout)."""

    file: str
    line: int
    layout: str
    status: str
    sql: str
    rule: str | None = None
    detail: str = ""
    note: str = ""
    expected: list[str] | None = None
    actual: list[str] | None = None


@dataclass
class Report:
    cases: list[Case] = field(default_factory=list)
    skipped_files: Counter[str] = field(default_factory=Counter)
    file_seconds: dict[str, float] = field(default_factory=dict)
    setup_failures: int = 0
    """`statement ok` records DuckDB refused (the oracle goes on from its own state)."""

    def count(self, status: str) -> int:
        return sum(1 for c in self.cases if c.status == status)

    def skip_rules(self) -> Counter[str]:
        return Counter(c.rule or "?" for c in self.cases if c.status == SKIPPED)

    def summary_line(self) -> str:
        n, u, w = self.count(EQUAL), self.count(UNSUPPORTED), self.count(WRONG)
        s = self.count(SKIPPED)
        return f"conformance: {n}/{n + u + w} equal, {u} unsupported, {w} wrong, {s} skipped"

    def to_json(self) -> dict[str, Any]:
        n, u, w = self.count(EQUAL), self.count(UNSUPPORTED), self.count(WRONG)
        return {
            "summary": self.summary_line(),
            "equal": n,
            "unsupported": u,
            "wrong": w,
            "compared": n + u + w,
            "skipped": self.count(SKIPPED),
            "skip_rules": dict(self.skip_rules().most_common()),
            "skipped_files": dict(self.skipped_files.most_common()),
            "rules": RULES,
            "setup_failures": self.setup_failures,
            "file_seconds": self.file_seconds,
            "cases": [
                {k: v for k, v in asdict(c).items() if v not in (None, "", [])} for c in self.cases
            ],
        }

    def render(self, out: Callable[[str], None], max_listed: int = 400) -> None:
        """Per-rule skips, unsupported messages, every wrong case; the summary line last."""
        out(f"files skipped whole, by rule: {dict(self.skipped_files.most_common())}")
        out("skipped queries by rule:")
        for rule, count in self.skip_rules().most_common():
            out(f"  {count:6d}  {rule}")
        unsupported = Counter(c.detail for c in self.cases if c.status == UNSUPPORTED)
        if unsupported:
            out("unsupported, by message:")
            for message, count in unsupported.most_common(15):
                out(f"  {count:6d}  {message[:160]}")
        wrong = [c for c in self.cases if c.status == WRONG]
        if wrong:
            out(f"wrong ({len(wrong)}):")
            for c in wrong[:max_listed]:
                sql = " ".join(c.sql.split())
                out(f"  {c.file}:{c.line} [{c.layout}] {sql[:200]}")
                out(f"      -> {c.detail[:300]}")
            if len(wrong) > max_listed:
                out(f"  ... {len(wrong) - max_listed} more in the JSON report")
        out(self.summary_line())


# --------------------------------------------------------------------------------------
# comparison


def _tables_read(sql: str, changed: str) -> set[str]:
    """The tables (names, lower-cased) a DELETE or UPDATE reads besides the one it changes:
    its USING or FROM and its subqueries' (common table expressions left out)."""
    try:
        tree = sqlglot.parse_one(sql, read="duckdb")
    except sqlglot.errors.SqlglotError:
        return set()
    ctes = {cte.alias_or_name.lower() for cte in tree.find_all(exp.CTE)}
    found = {t.name.lower() for t in tree.find_all(exp.Table) if t.name}
    return found - ctes - {changed}


def _updates_from(sql: str) -> bool:
    try:
        tree = sqlglot.parse_one(sql, read="duckdb")
    except sqlglot.errors.SqlglotError:
        return False
    return isinstance(tree, exp.Update) and tree.args.get("from_") is not None


def _first_lines(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:n])


def _same_distinct(actual: pa.Table, expected: pa.Table) -> bool:
    """Whether two answers hold the same distinct rows (``RETURNING`` of an UPDATE ...
    FROM: DuckDB gives a row per match, shardflow per row changed)."""
    return {tuple(r.values()) for r in actual.to_pylist()} == {
        tuple(r.values()) for r in expected.to_pylist()
    }


def compare(
    actual: pa.Table,
    expected: pa.Table,
    facts: QueryFacts,
    sort: str,
    full: Callable[[], pa.Table | None] = lambda: None,
) -> str | None:
    """None if ``actual`` is an answer the query may give, else why not (one line).

    * ``valuesort``: the same multiset of cell values;
    * an outer LIMIT/OFFSET: :func:`assert_limited_result` against the oracle's answer
      and its answer without the LIMIT (``full``);
    * ``rowsort``, or no outer ORDER BY: the same multiset of rows;
    * otherwise in order, rows tying on the ORDER BY keys in any order.

    Values are compared (numeric types may differ, floats within 1e-9 relative), column
    names are not (sqllogictest does not check them; the runner notes differences).
    Values Python cannot hold (timestamps beyond year 9999, ...) are compared as DuckDB
    prints them.
    """
    try:
        return _compare(actual, expected, facts, sort, full)
    except (pa.ArrowException, OverflowError, ValueError, TypeError):
        pass
    try:
        whole = full()
        return _compare(
            _as_text(actual),
            _as_text(expected),
            facts,
            sort,
            lambda: _as_text(whole) if whole is not None else None,
        )
    except (pa.ArrowException, duckdb.Error, OverflowError, ValueError, TypeError) as error:
        return f"the runner cannot compare these answers: {type(error).__name__}: {error}"[:400]


def _as_text(table: pa.Table) -> pa.Table:
    """Every column as DuckDB renders it (VARCHAR)."""
    names = [f"c{i}" for i in range(table.num_columns)]
    renamed = table.rename_columns(names)
    con = duckdb.connect()
    try:
        con.register("__sf_answer", renamed)
        select = ", ".join(f"CAST({n} AS VARCHAR) AS {n}" for n in names) or "*"
        return con.sql(f"SELECT {select} FROM __sf_answer").to_arrow_table()
    finally:
        con.close()


def _compare(
    actual: pa.Table,
    expected: pa.Table,
    facts: QueryFacts,
    sort: str,
    full: Callable[[], pa.Table | None],
) -> str | None:
    try:
        if sort == "valuesort":
            assert_same_values(actual, expected)
            return None
        keys: list[int] | None = None
        if facts.ordered:
            try:
                keys = sort_key_indexes(facts.sql, expected.column_names)
            except Exception:
                keys = None  # unparsable: strict order
        if facts.limited:
            try:  # the oracle's own rows: the usual case, and no need for the full answer
                if sort == "rowsort" or not facts.ordered:
                    assert_same_result(actual, expected, ordered=False, check_names=False)
                else:
                    assert_same_result(
                        actual, expected, ordered=True, sort_keys=keys, check_names=False
                    )
                return None
            except AssertionError:
                pass
            whole = full()
            if whole is not None:
                assert_limited_result(
                    actual,
                    expected,
                    whole,
                    sort_keys=keys or [],
                    ordered=facts.ordered and sort != "rowsort" and keys is not None,
                )
                return None
        if sort == "rowsort" or not facts.ordered:
            assert_same_result(actual, expected, ordered=False, check_names=False)
        else:
            assert_same_result(actual, expected, ordered=True, sort_keys=keys, check_names=False)
    except AssertionError as error:
        return _diff_line(str(error))
    return None


def _diff_line(message: str) -> str:
    """The oracle's multi-line message in one line: the reason and the first difference."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith("context:")]
    reason = keep[0] if keep else message
    detail = ""
    for i, line in enumerate(keep):
        if line.startswith("first differing row") and i + 2 < len(keep):
            detail = f"; {keep[i + 1]} / {keep[i + 2]}"
            break
    return (reason + detail)[:400]


def _preview(table: pa.Table, n: int = 5) -> list[str]:
    head = table.slice(0, n)
    try:
        columns = [c.to_pylist() for c in head.columns]
    except (pa.ArrowException, OverflowError, ValueError):
        columns = [c.to_pylist() for c in _as_text(head).columns]
    out = [repr(row) for row in zip(*columns, strict=True)]
    if table.num_rows > n:
        out.append(f"... {table.num_rows - n} more rows")
    return out


# --------------------------------------------------------------------------------------
# one file


@dataclass
class _Loaded:
    name: str
    fingerprint: tuple[Any, ...]
    refused: str | None = None
    """The skip rule for queries reading it, when shardflow does not hold it."""
    detail: str = ""


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class _Oracle:
    """Per-run DuckDB facts: a fresh connection's settings, and a scratch connection to see
    which DuckDB types survive the Arrow round trip shardflow stores tables with."""

    def __init__(self) -> None:
        fresh = duckdb.connect()
        self.defaults = dict(fresh.execute("SELECT name, value FROM duckdb_settings()").fetchall())
        self.extensions = {
            name
            for name, loaded in fresh.execute(
                "SELECT extension_name, loaded FROM duckdb_extensions()"
            ).fetchall()
            if loaded
        }
        fresh.close()
        self.scratch = duckdb.connect()

    def types_after_arrow(self, data: pa.Table) -> list[str]:
        stored = data.cast(storage_schema(data.schema))
        self.scratch.register("__sf_stored", stored)
        try:
            return [r[1] for r in self.scratch.execute("DESCRIBE __sf_stored").fetchall()]
        finally:
            self.scratch.unregister("__sf_stored")

    def unmet_requirement(self, args: Sequence[str]) -> str | None:
        if not args:
            return "require"
        name = args[0]
        if name == "vector_size" and len(args) > 1 and args[1].isdigit():
            return None if _DUCKDB_VECTOR_SIZE >= int(args[1]) else "require vector_size"
        if name == "exact_vector_size" and len(args) > 1 and args[1].isdigit():
            return None if _DUCKDB_VECTOR_SIZE == int(args[1]) else "require vector_size"
        if name in _MET_REQUIREMENTS or name in self.extensions:
            return None
        return "require"


def _base_type(duck_type: str) -> str:
    return re.split(r"[(\[<]", duck_type, maxsplit=1)[0].strip().upper() or duck_type


class FileRun:
    """All passes (layouts) over one file."""

    def __init__(
        self,
        path: Path,
        rel: str,
        backend: Backend,
        oracle: _Oracle,
        report: Report,
        changes: bool = False,
    ) -> None:
        self.path, self.rel, self.backend, self.oracle = path, rel, backend, oracle
        self.report = report
        self.changes = changes
        """Run the file's DELETEs and UPDATEs in shardflow too (:meth:`_PassState._change`)."""
        self.skipped_once: set[int] = set()
        self.no_table_done: set[int] = set()
        self.schemas: dict[str, pa.Schema] = {}
        self.join_sql: list[str] = []

    # ---- whole file
    def run(self) -> None:
        text = self.path.read_text(errors="replace")
        try:
            records = expand(parse(text, self.rel))
        except (SltParseError, ValueError) as error:
            count = len(re.findall(r"^query\s", text, flags=re.MULTILINE))
            self._skip_file("unparsable file", count, str(error))
            return
        rule = self._file_rule(records)
        if rule is not None:
            self._skip_file(rule, sum(isinstance(r, Query) for r in records), "")
            return
        plans: list[LayoutPlan] = [FIRST_COLUMN]
        done: list[str] = []
        while plans:
            plan = plans.pop(0)
            self._pass(records, plan, first=not done)
            done.append(plan.name)
            if len(done) == 1:
                plans = plan_layouts(self.schemas, self.join_sql)[1:]

    def _file_rule(self, records: Sequence[Record]) -> str | None:
        for record in records:
            if not isinstance(record, Command):
                continue
            if record.name == "require":
                unmet = self.oracle.unmet_requirement(record.args)
                if unmet:
                    return f"{unmet} {' '.join(record.args[:1])}".strip()
            elif record.name in ("load", "restart", "reconnect", "unzip"):
                return "persistent database"
            elif record.name == "include":
                return "include"
            elif record.name == "require-env":
                return "require-env"
        return None

    def _skip_file(self, rule: str, queries: int, detail: str) -> None:
        self.report.skipped_files[rule] += 1
        for _ in range(queries):
            self.report.cases.append(Case(self.rel, 0, "-", SKIPPED, "", rule, detail[:200]))

    # ---- one layout
    def _pass(self, records: Sequence[Record], plan: LayoutPlan, first: bool) -> None:
        with tempfile.TemporaryDirectory(prefix="sf-slt-") as test_dir:
            state = _PassState(self, plan, first, test_dir)
            try:
                state.run(records)
            finally:
                state.close()

    def record(self, case: Case, index: int, layout_free: bool) -> None:
        """Record a case; a layout-free skip only once per query across passes."""
        if layout_free:
            if index in self.skipped_once:
                return
            self.skipped_once.add(index)
        self.report.cases.append(case)


class _PassState:
    def __init__(self, run: FileRun, plan: LayoutPlan, first: bool, test_dir: str) -> None:
        self.run_, self.plan, self.first, self.test_dir = run, plan, first, test_dir
        self.con = duckdb.connect()
        self.loaded: dict[str, _Loaded] = {}
        self.current: dict[str, tuple[str, str]] = {}
        self.views: set[str] = set()
        self.macros: set[str] = set()
        self.settings: list[str] = []
        self.null_order: str | None = None
        self.search_path_moved = False
        self.generation, self.synced = 1, 0
        self.in_transaction = False
        """Inside BEGIN ... COMMIT | ROLLBACK: a DELETE or UPDATE there is DuckDB's alone
        (shardflow's statements commit each on its own)."""
        self.restarts = run.backend.restarts
        self.timeouts = 0

    def close(self) -> None:
        for table in list(self.loaded.values()):
            if table.refused is None:
                self._drop(table.name)
        self.loaded.clear()
        self.con.close()

    def _subst(self, sql: str) -> str:
        return sql.replace("{TEST_DIR}", self.test_dir).replace("__TEST_DIR__", self.test_dir)

    # ---- the records
    def run(self, records: Sequence[Record]) -> None:
        skipping = False
        for index, record in enumerate(records):
            if isinstance(record, Command):
                if record.name == "mode" and record.args[:1] == ("skip",):
                    skipping = True
                elif record.name == "mode" and record.args[:1] == ("unskip",):
                    skipping = False
                elif record.name == "halt":
                    for j in range(index + 1, len(records)):
                        if isinstance(records[j], Query):
                            self._skip(j, records[j], "halt")  # type: ignore[arg-type]
                    return
                continue
            if not all(c.runs_on("duckdb") for c in record.conditions):
                if isinstance(record, Query):
                    self._skip(index, record, "skipif/onlyif")
                continue
            if skipping:
                if isinstance(record, Query):
                    self._skip(index, record, "mode skip")
                continue
            if isinstance(record, Statement):
                self._statement(index, record)
            else:
                self._query(index, record)

    def _statement(self, index: int, record: Statement) -> None:
        sql = self._subst(record.sql)
        keyword = first_keyword(sql)
        target = self._changed_table(sql) if self.run_.changes else None
        if target is not None and self.in_transaction:
            case = Case(self.run_.rel, record.line, self.plan.name, SKIPPED, sql)
            case.rule = "inside a transaction"
            self.run_.report.cases.append(case)
            target = None
        if target is not None:
            self._sync()  # shardflow's copy as DuckDB's table is just before the statement
        if keyword in ("BEGIN", "START"):
            self.in_transaction = True
        elif keyword in ("COMMIT", "ROLLBACK", "END", "ABORT"):
            self.in_transaction = False
        if keyword not in READ_ONLY_KEYWORDS:
            self.generation += 1
        counted: Any = None
        try:
            answer = self.con.execute(sql).fetchall()
            counted = answer[0][0] if answer and answer[0] else None
        except duckdb.Error:
            if record.expect == "ok" and self.first:
                self.run_.report.setup_failures += 1
        if self.first:
            self.run_.join_sql.append(sql)
        if target is not None:
            self._change(index, record, sql, target, counted)

    def _changed_table(self, sql: str) -> str | None:
        """The table a DELETE or UPDATE changes (its name, lower-cased), or None where
        ``sql`` is no such statement."""
        try:
            tree = sqlglot.parse_one(sql, read="duckdb")
        except sqlglot.errors.SqlglotError:
            return None
        if not isinstance(tree, exp.Delete | exp.Update) or not isinstance(tree.this, exp.Table):
            return None
        if tree.this.args.get("db") or tree.this.args.get("catalog"):
            return None
        return tree.this.name.lower()

    def _change(
        self,
        index: int,
        record: Statement | Query,
        sql: str,
        key: str,
        counted: Any,
        returned: pa.Table | None = None,
    ) -> None:
        """Run a DELETE or UPDATE DuckDB ran in shardflow too: the rows changed must be as
        many (a ``query`` record's ``RETURNING``: the rows DuckDB ``returned``, compared as
        a query's answer is), and the table's content (compared by the queries that
        follow, with no load in between) the same."""
        layout = self.plan.name

        def case(status: str, rule: str | None = None, detail: str = "") -> None:
            found = Case(self.run_.rel, record.line, layout, status, sql, rule, detail[:300])
            self.run_.report.cases.append(found)

        loaded = self.loaded.get(key)
        refused = isinstance(record, Statement) and record.expect != "ok"
        if refused or not isinstance(counted, int):
            case(SKIPPED, "statement DuckDB refuses")
            return
        if loaded is None or loaded.refused is not None or key not in self.current:
            case(SKIPPED, "table not held")
            return
        for read in _tables_read(sql, key):
            held = self.loaded.get(read)
            if held is None or held.refused is not None or read not in self.current:
                case(SKIPPED, "table not held", read)
                return
        from shardflow.errors import UnsupportedError

        try:
            answer = self.run_.backend.sql(sql)
        except UnsupportedError as error:
            case(UNSUPPORTED, detail=_first_lines(str(error), 1))
            return  # the next query's load brings shardflow's copy to DuckDB's
        except Exception as error:
            case(WRONG, detail=f"{type(error).__name__}: {_first_lines(str(error), 1)}")
            return
        if returned is not None and isinstance(record, Query):
            problem = compare(answer, returned, analyze(sql), record.sort)
            if problem is not None and _updates_from(sql) and _same_distinct(answer, returned):
                case(SKIPPED, "UPDATE ... FROM counts matches", problem)
            elif problem is not None:
                case(WRONG, detail=problem)
                return
            else:
                case(EQUAL)
            loaded.fingerprint = self._fingerprint(self.current[key][0])
            return
        got = answer.column("count")[0].as_py()
        if got != counted and not (_updates_from(sql) and 0 < got < counted):
            case(WRONG, detail=f"shardflow changed {got} rows, DuckDB {counted}")
            return
        if got != counted:
            case(SKIPPED, "UPDATE ... FROM counts matches", f"{got} rows, {counted} matches")
        else:
            case(EQUAL)
        loaded.fingerprint = self._fingerprint(self.current[key][0])  # kept: no load

    def _skip(self, index: int, record: Query, rule: str, detail: str = "") -> None:
        case = Case(self.run_.rel, record.line, "-", SKIPPED, record.sql, rule, detail[:300])
        self.run_.record(case, index, layout_free=True)

    # ---- a query
    def _query(self, index: int, record: Query) -> None:
        sql = self._subst(record.sql)
        keyword = first_keyword(sql)
        target = self._changed_table(sql) if self.run_.changes and not self.in_transaction else None
        if target is not None:  # DELETE or UPDATE ... RETURNING: DuckDB's rows the oracle
            self._sync()
            self.generation += 1
            try:
                returned: pa.Table | None = self._oracle(sql)
            except (duckdb.Error, pa.ArrowException):
                returned = None
            if self.first:
                self.run_.join_sql.append(sql)
            counted: Any = None
            if returned is not None and returned.column_names == ["Count"]:
                counted, returned = returned.column(0)[0].as_py(), None  # no RETURNING
            elif returned is not None:
                counted = returned.num_rows
            self._change(index, record, sql, target, counted, returned)
            return
        if keyword not in QUERY_KEYWORDS:
            self.generation += 1
            try:
                self.con.execute(sql).complete()
            except duckdb.Error:
                pass
            self._skip(index, record, "not a SELECT", keyword)
            return
        try:
            expected = self._oracle(sql)
        except (duckdb.Error, pa.ArrowException) as error:
            rule = "duckdb timeout" if isinstance(error, duckdb.InterruptException) else None
            self._skip(index, record, rule or "duckdb error", _first_lines(str(error), 1))
            return
        facts = analyze(sql)
        if facts.tree is not None and not isinstance(outer_query(facts.tree), QUERY_NODES):
            self.generation += 1  # WITH ... INSERT/UPDATE/DELETE: it ran, and changed data
            self._skip(index, record, "not a SELECT", facts.tree.key.upper())
            return
        if self.first:
            self.run_.join_sql.append(sql)
        self._sync()
        rule, detail = self._rule(facts)
        if rule == "shardflow cannot store the table":  # may hold for this layout only
            case = Case(self.run_.rel, record.line, self.plan.name, SKIPPED, sql, rule, detail)
            self.run_.report.cases.append(case)
            return
        if rule is not None:
            self._skip(index, record, rule, detail)
            return
        reads = facts.tables & set(self.current)
        layout = self.plan.name
        if facts.tree is not None and not reads:
            if index in self.run_.no_table_done:
                return  # compared in the first layout: the answer reads no table
            self.run_.no_table_done.add(index)
            layout = "no tables"
        shardflow_sql = sql
        if self.null_order is not None:
            shardflow_sql = self._with_null_order(facts, expected)
            if shardflow_sql is None:
                detail = f"default_null_order={self.null_order} (no equivalent text)"
                self._skip(index, record, "setting", detail)
                return
        self._compare(index, record, shardflow_sql, facts, expected, layout)
        if shardflow_sql != sql:
            case = self.run_.report.cases[-1]
            note = f"{NULL_ORDER}={self.null_order}: NULLS FIRST/LAST written out"
            case.note = f"{case.note}; {note}" if case.note else note

    def _with_null_order(self, facts: QueryFacts, expected: pa.Table) -> str | None:
        """The query with the session's null order written out, if DuckDB answers it the
        same under its default null order."""
        assert self.null_order is not None
        rewritten = with_null_order(facts, self.null_order)
        if rewritten is None:
            return None
        default = self.run_.oracle.defaults.get(NULL_ORDER, "nulls_last")
        self.con.execute(f"SET {NULL_ORDER} = '{default}'").complete()
        try:
            answer = self._oracle(rewritten)
        except (duckdb.Error, pa.ArrowException):
            return None
        finally:
            self.con.execute(f"SET {NULL_ORDER} = '{self.null_order}'").complete()
        same = compare(answer, expected, facts, "nosort") is None
        return rewritten if same else None

    def _oracle(self, sql: str) -> pa.Table:
        """DuckDB's answer; interrupted (a duckdb.Error) after ORACLE_TIMEOUT_S."""
        timer = threading.Timer(ORACLE_TIMEOUT_S, self.con.interrupt)
        timer.start()
        try:
            return self.con.sql(sql).to_arrow_table()
        finally:
            timer.cancel()

    def _rule(self, facts: QueryFacts) -> tuple[str | None, str]:
        if facts.external_data:
            return "external data file", ""
        catalog = sorted(f for f in facts.table_functions if CATALOG_FUNCTIONS.match(f))
        if catalog:
            return "catalog table function", ", ".join(catalog)
        if facts.volatile:
            return "volatile function", ", ".join(sorted(facts.volatile))
        if facts.sampled:
            return "sample", ""
        if facts.qualified_tables:
            return "qualified table name", ", ".join(sorted(facts.qualified_tables))
        if facts.tables & self.views:
            return "view", ", ".join(sorted(facts.tables & self.views))
        used = (facts.functions | facts.table_functions) & self.macros
        if used:
            return "macro", ", ".join(sorted(used))
        if "getvariable" in facts.functions:
            return "session variable", ""
        if self.search_path_moved:
            return "search path", ""
        if self.settings:
            return "setting", ", ".join(self.settings)
        unknown = facts.tables - set(self.current) - self.views
        if unknown and facts.tree is not None:
            return "unknown relation", ", ".join(sorted(unknown))
        for name in sorted(facts.tables & set(self.current)):
            table = self.loaded.get(name)
            if table is not None and table.refused is not None:
                return table.refused, f"{table.name}: {table.detail}"
        return None, ""

    def _compare(
        self,
        index: int,
        record: Query,
        sql: str,
        facts: QueryFacts,
        expected: pa.Table,
        layout: str,
    ) -> None:
        from shardflow.errors import UnsupportedError

        case = Case(self.run_.rel, record.line, layout, EQUAL, sql)
        if self.timeouts >= MAX_TIMEOUTS_PER_PASS:
            case.status, case.rule = SKIPPED, "cluster hung earlier in the file"
            self.run_.report.cases.append(case)
            return
        try:
            actual = self.run_.backend.sql(sql)
        except UnsupportedError as error:
            message = _first_lines(str(error), 1)
            if facts.table_functions:
                case.status, case.rule, case.detail = SKIPPED, "table function refused", message
            else:
                case.status, case.detail = UNSUPPORTED, message
            self.run_.report.cases.append(case)
            return
        except Exception as error:
            if isinstance(error, QueryTimeout):
                self.timeouts += 1
            case.status = WRONG
            case.detail = f"{type(error).__name__}: {_first_lines(str(error), 2)}"[:400]
            case.expected = _preview(expected)
            self.run_.report.cases.append(case)
            return
        full_cache: list[pa.Table | None] = []

        def full() -> pa.Table | None:
            if not full_cache:
                whole = without_limit(facts)
                capped = f"SELECT * FROM ({whole}) AS __sf_full LIMIT {FULL_ANSWER_ROWS + 1}"
                try:
                    answer = self._oracle(capped) if whole is not None else None
                except (duckdb.Error, pa.ArrowException):
                    answer = None
                too_big = answer is not None and answer.num_rows > FULL_ANSWER_ROWS
                full_cache.append(None if too_big else answer)
            return full_cache[0]

        problem = compare(actual, expected, facts, record.sort, full)
        if problem is not None:
            variants = self._permuted_answers(sql, facts)
            dependent = [v for v in variants if compare(v, expected, facts, record.sort, full)]
            if dependent:
                if any(compare(actual, v, facts, record.sort, full) is None for v in variants):
                    case.note = "order-dependent: equals DuckDB's answer over permuted rows"
                    problem = None
                else:
                    case.status, case.rule = SKIPPED, "order-dependent answer"
            if problem is not None:
                if case.status != SKIPPED:
                    case.status = WRONG
                case.detail = problem
                case.expected, case.actual = _preview(expected), _preview(actual)
        if case.status == EQUAL and actual.column_names != expected.column_names:
            case.note = (
                case.note
                or f"column names differ: {actual.column_names[:6]} vs {expected.column_names[:6]}"
            )
        self.run_.report.cases.append(case)

    def _permuted_answers(self, sql: str, facts: QueryFacts) -> list[pa.Table]:
        """DuckDB's answers to ``sql`` over the same tables with their rows stored reversed
        and shuffled; [] where that cannot be set up."""
        names = facts.tables & set(self.current) if facts.tree is not None else set(self.current)
        answers: list[pa.Table] = []
        for order in ("rowid DESC", "hash(rowid + 7), rowid"):
            try:
                self.con.execute("ATTACH ':memory:' AS __sf_perm").complete()
            except duckdb.Error:
                return answers
            try:
                for name in names:
                    ref, real = self.current[name]
                    self.con.execute(
                        f"CREATE TABLE __sf_perm.main.{_quote(real)} AS "
                        f"SELECT * FROM {ref} ORDER BY {order}"
                    ).complete()
                self.con.execute("USE __sf_perm").complete()
                try:
                    answers.append(self._oracle(sql))
                finally:
                    self.con.execute("USE memory").complete()
            except (duckdb.Error, pa.ArrowException):
                pass
            finally:
                self.con.execute("DETACH __sf_perm").complete()
        chunked = self._chunked_answer(sql, names)
        if chunked is not None:
            answers.append(chunked)
        return answers

    def _chunked_answer(self, sql: str, names: set[str]) -> pa.Table | None:
        """DuckDB's answer over the same rows as Arrow data cut into small chunks, scanned
        by 4 threads, as shardflow's client scans gathered shards (some of DuckDB's
        aggregates combine per-thread states order-dependently); None where that cannot be
        set up."""
        con = duckdb.connect()
        try:
            con.execute("SET threads = 4")
            for name in names:
                ref, real = self.current[name]
                data = self.con.sql(f"SELECT * FROM {ref}").to_arrow_table()
                size = max(1, data.num_rows // 8)
                con.register(real, pa.Table.from_batches(data.to_batches(max_chunksize=size)))
            timer = threading.Timer(ORACLE_TIMEOUT_S, con.interrupt)
            timer.start()
            try:
                return con.sql(sql).to_arrow_table()
            finally:
                timer.cancel()
        except (duckdb.Error, pa.ArrowException):
            return None
        finally:
            con.close()

    # ---- keeping shardflow's tables equal to DuckDB's
    def _sync(self) -> None:
        if self.restarts != self.run_.backend.restarts:  # a fresh cluster holds nothing
            self.restarts = self.run_.backend.restarts
            self.loaded.clear()
            self.synced = 0
        if self.synced == self.generation:
            return
        self.synced = self.generation
        con = self.con
        current: dict[str, tuple[str, str]] = {}
        rows = con.execute(
            "SELECT database_name, schema_name, table_name, temporary FROM duckdb_tables() "
            "ORDER BY temporary"
        ).fetchall()
        for database, schema, name, temporary in rows:
            if temporary or (database == "memory" and schema == "main"):
                current[name.lower()] = (
                    f"{_quote(database)}.{_quote(schema)}.{_quote(name)}",
                    name,
                )
        self.current = current
        self.views = {
            r[0].lower()
            for r in con.execute(
                "SELECT view_name FROM duckdb_views() WHERE NOT internal"
            ).fetchall()
        }
        self.macros = {
            r[0].lower()
            for r in con.execute(
                "SELECT function_name FROM duckdb_functions() WHERE NOT internal"
            ).fetchall()
        }
        defaults = self.run_.oracle.defaults
        changed = {
            name: value
            for name, value in con.execute("SELECT name, value FROM duckdb_settings()").fetchall()
            if name not in HARMLESS_SETTINGS
            and name in defaults
            and defaults[name] != value
            and not (name == "search_path" and value.lower() in ("main", "memory.main"))
        }
        changed.pop("null_order", None)  # the same setting under its other name
        self.null_order = changed.pop(NULL_ORDER, None)
        self.settings = [f"{name}={value}" for name, value in changed.items()]
        where = con.execute("SELECT current_database(), current_schema()").fetchall()[0]
        self.search_path_moved = where != ("memory", "main")
        for key in [k for k in self.loaded if k not in current]:
            table = self.loaded.pop(key)
            if table.refused is None:
                self._drop(table.name)
        for key, (ref, name) in current.items():
            fingerprint = self._fingerprint(ref)
            table = self.loaded.get(key)
            if table is not None and table.fingerprint == fingerprint and table.name == name:
                continue
            if table is not None:
                self.loaded.pop(key)
                if table.refused is None:
                    self._drop(table.name)
            self.loaded[key] = self._load(key, ref, name, fingerprint)
        if self.first:
            for key, (ref, _) in current.items():
                try:
                    schema = con.sql(f"SELECT * FROM {ref} LIMIT 0").to_arrow_table().schema
                except (duckdb.Error, pa.ArrowException):
                    continue
                self.run_.schemas[key] = schema

    def _fingerprint(self, ref: str) -> tuple[Any, ...]:
        try:
            types = tuple(self.con.execute(f"DESCRIBE {ref}").fetchall())
            count, total, texts = self.con.execute(
                # the row's text too: hash() gives NULL and [NULL] the same value
                f"SELECT count(*), sum(hash(__sf_row))::VARCHAR, "
                f"sum(hash(__sf_row::VARCHAR))::VARCHAR FROM {ref} AS __sf_row"
            ).fetchall()[0]
            return (types, count, total, texts)
        except duckdb.Error:
            return (time.monotonic_ns(),)  # unknown: always reload

    def _load(self, key: str, ref: str, name: str, fingerprint: tuple[Any, ...]) -> _Loaded:
        loaded = _Loaded(name, fingerprint)
        try:
            data = self.con.sql(f"SELECT * FROM {ref}").to_arrow_table()
            types = [r[1] for r in self.con.execute(f"DESCRIBE {ref}").fetchall()]
            after = self.run_.oracle.types_after_arrow(data)
        except (duckdb.Error, pa.ArrowException, ValueError, TypeError) as error:
            loaded.refused = "type changes through Arrow"
            loaded.detail = _first_lines(str(error), 1)[:200]
            return loaded
        changed = [(a, b) for a, b in zip(types, after, strict=False) if a != b]
        if changed or len(types) != len(after):
            loaded.refused = "type changes through Arrow"
            a, b = changed[0] if changed else ("?", "?")
            loaded.detail = f"{_base_type(a)} -> {_base_type(b)}"
            return loaded
        if self._collated(key):
            loaded.refused = "collated column (Arrow columns carry no collation)"
            return loaded
        placement = self.plan.place(key, data.schema, self._held())
        try:
            self.run_.backend.create_table(
                name,
                data,
                distributed_by=placement.distributed_by,
                replicated=placement.replicated,
                colocate_with=placement.colocate_with,
            )
        except Exception as error:
            loaded.refused = "shardflow cannot store the table"
            loaded.detail = f"{type(error).__name__}: {_first_lines(str(error), 1)}"[:200]
            self._drop(name)  # a load that failed leaves nothing behind; make sure of it
        return loaded

    def _collated(self, key: str) -> bool:
        """Whether table ``key`` has a column with a COLLATE clause: shardflow's tables are
        Arrow tables, which compare strings byte by byte, so no answer could match."""
        rows = self.con.execute(
            "SELECT sql FROM duckdb_tables() WHERE lower(table_name) = ?", [key]
        ).fetchall()
        return any(sql and " COLLATE " in sql.upper() for (sql,) in rows)

    def _held(self) -> dict[str, str]:
        """Tables shardflow holds now: lower-cased name -> name."""
        return {k: t.name for k, t in self.loaded.items() if t.refused is None}

    def _drop(self, name: str) -> None:
        try:
            self.run_.backend.drop_table(name)
        except Exception:
            pass  # a later load of the same name reports the failure


# --------------------------------------------------------------------------------------
# many files


def run_files(
    files: Iterable[Path],
    root: Path,
    backend: Backend,
    progress: Callable[[str], None] | None = None,
    changes: bool = False,
) -> Report:
    """Run ``files``; with ``changes`` their DELETEs and UPDATEs run in shardflow too, each
    a case (its count of changed rows against DuckDB's; the queries after it compare the
    table's content), instead of shardflow's copy being loaded again after them."""
    logging.getLogger("sqlglot").setLevel(logging.ERROR)  # "falling back to Command" noise
    report = Report()
    oracle = _Oracle()
    for path in files:
        rel = path.relative_to(root).as_posix()
        if progress is not None:
            progress(rel)
        started = time.perf_counter()
        try:
            FileRun(path, rel, backend, oracle, report, changes).run()
        except Exception as error:  # a bug of the runner: loud, and it fails the gate
            detail = f"runner error: {type(error).__name__}: {_first_lines(str(error), 1)}"
            report.cases.append(Case(rel, 0, "runner", WRONG, "", detail=detail[:400]))
        report.file_seconds[rel] = round(time.perf_counter() - started, 3)
    return report


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1, default=str))
