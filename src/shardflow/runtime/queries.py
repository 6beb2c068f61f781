"""From SQL text to an answer, the same way for every runner: plan the query, bind it in
DuckDB for its output names and types, and where the planner cannot take apart a query
that DuckDB answers, run it as written over the tables it names, gathered whole.

The session uses this over Ray workers; the in-process cluster of the tests and the
conformance gate use it over in-process shards, so both take the same fallbacks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from shardflow.catalog import Catalog
from shardflow.engine import DuckDBEngine
from shardflow.errors import (
    NotDistributable,
    QueryError,
    SqlSyntaxError,
    StageRefused,
    UnknownColumnError,
    UnknownTableError,
    UnreadableSql,
    UnsupportedError,
)
from shardflow.runtime.executor import ExecutionReport, Runner, execute, query_error
from shardflow.sql import DistributedPlan, gather_plan, plan
from shardflow.sql.parse import is_select, refuse_row_ids_in_text

__all__ = ["Binder", "PlannedQuery", "answer", "plan_query"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedQuery:
    plan: DistributedPlan
    schema: pa.Schema
    """The result schema DuckDB gives the query: the answer is returned with these names."""
    plan_seconds: float


class Binder:
    """Binds queries in DuckDB over empty tables of the catalog: type errors, unknown
    functions and the like surface here with DuckDB's own message, before any worker is
    asked, and the bound schema names and types the answer."""

    def __init__(self, engine: DuckDBEngine) -> None:
        self.engine = engine
        self._empties: tuple[int, dict[str, pa.Table]] | None = None

    def schema(self, sql: str, catalog: Catalog) -> pa.Schema:
        empties = self._empties
        if empties is None or empties[0] != catalog.version:
            tables = {n: s.schema.empty_table() for n, s in catalog.tables.items()}
            empties = self._empties = (catalog.version, tables)
        try:
            return self.engine.run(sql, empties[1]).schema
        except duckdb.ParserException as error:
            raise SqlSyntaxError(str(error).strip()) from None
        except duckdb.BinderException as error:
            message = str(error).strip()
            if "not found" in message and "olumn" in message:
                raise UnknownColumnError(message) from None
            mapped = query_error(error)
            if isinstance(mapped, UnsupportedError):
                raise mapped from None
            raise QueryError(message) from None
        except duckdb.CatalogException as error:
            message = str(error).strip()
            if "Table with name" in message:
                raise UnknownTableError(message) from None
            raise QueryError(message) from None
        except duckdb.Error as error:
            raise QueryError(str(error).strip()) from None


def plan_query(sql: str, catalog: Catalog, binder: Binder) -> PlannedQuery:
    """The distributed plan of ``sql`` and its bound schema. A query the planner cannot
    read or take apart, but DuckDB binds, gets :func:`gather_plan`'s plan instead; the
    planner's own refusals (:class:`UnsupportedError` and the like) stand."""
    started = time.perf_counter()
    try:
        distributed = plan(sql, catalog)
        schema = binder.schema(sql, catalog)
    except UnreadableSql:
        if not is_select(sql):
            raise
        distributed, schema = _gather_if_bound(sql, catalog, binder, None)
    except (SqlSyntaxError, UnknownTableError):
        raise
    except UnsupportedError as error:
        if not isinstance(error, NotDistributable):
            raise
        distributed, schema = _gather_if_bound(sql, catalog, binder, error)
    except QueryError as error:
        distributed, schema = _gather_if_bound(sql, catalog, binder, error)
    return PlannedQuery(distributed, schema, time.perf_counter() - started)


def _gather_if_bound(
    sql: str, catalog: Catalog, binder: Binder, error: QueryError | None
) -> tuple[DistributedPlan, pa.Schema]:
    """:func:`gather_plan`'s plan for a query the planner could not distribute (``error``
    says why; None: shardflow's SQL parser cannot read it), if DuckDB binds it; else the
    planner's ``error`` stands, or DuckDB's own where there is none."""
    refuse_row_ids_in_text(sql, catalog)
    try:
        schema = binder.schema(sql, catalog)
    except UnsupportedError:
        raise
    except QueryError:
        if error is None:
            raise
        raise error from None
    why = f"could not distribute it ({error})" if error else "cannot read it"
    log.info("query gathered whole: the planner %s", why)
    return gather_plan(sql, catalog, f"the planner {why}"), schema


def answer(
    sql: str, planned: PlannedQuery, catalog: Catalog, runner: Runner, engine: DuckDBEngine
) -> tuple[pa.Table, ExecutionReport, PlannedQuery]:
    """Run ``planned`` and name and type its answer by the bound schema. If DuckDB refuses
    the SQL of a stage the planner wrote (it bound the query, so the fault is the
    planner's), the query runs as written over gathered tables; the plan that answered is
    returned so the caller can keep it."""
    try:
        result, report = execute(planned.plan, runner, engine)
    except StageRefused as error:
        if _gathers_whole(planned.plan):
            raise QueryError(str(error)) from None
        log.warning("query gathered whole: a distributed stage failed: %s", error)
        reason = f"a distributed stage failed ({error})"
        planned = dataclasses.replace(planned, plan=gather_plan(sql, catalog, reason))
        try:
            result, report = execute(planned.plan, runner, engine)
        except StageRefused as refused:
            raise QueryError(str(refused)) from None
    return _as_schema(result, planned.schema), report, planned


def _gathers_whole(plan: DistributedPlan) -> bool:
    """Whether ``plan`` is :func:`gather_plan`'s: the last stage runs the query as written."""
    return plan.result.sql == plan.sql and plan.result.placement == "client"


def _as_schema(result: pa.Table, schema: pa.Schema) -> pa.Table:
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
