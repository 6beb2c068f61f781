"""The DuckDB engine closes while other threads still run queries on it (what a session's
close() does under calls in flight): the close goes through, the queries fail fast."""

from __future__ import annotations

import threading
import time

import duckdb
import pyarrow as pa

from shardflow.engine import DuckDBEngine


def test_close_while_queries_run_goes_through() -> None:
    engine = DuckDBEngine()
    rows = pa.table({"a": pa.array(range(2_000_000), pa.int64())})
    running = threading.Barrier(3)
    errors: list[BaseException] = []

    def busy() -> None:
        running.wait()
        try:
            while True:
                engine.run("SELECT sum(a * a) FROM t", {"t": rows})
        except duckdb.Error as error:
            errors.append(error)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    running.wait()
    time.sleep(0.3)  # both threads are inside DuckDB now, most of the time
    engine.close()  # DuckDB refuses a close that meets a running call; the engine insists
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all("closed" in str(e) for e in errors), errors


def test_duckdbs_refusal_of_a_stage_is_told_from_an_error_in_the_data() -> None:
    from shardflow.errors import QueryError, StageRefused
    from shardflow.runtime.executor import query_error

    con = duckdb.connect()
    refusals = ["SELECT nosuch FROM range(3)", "SELEC 1", "SELECT * FROM nosuch"]
    for sql in refusals:
        try:
            con.sql(sql)
        except duckdb.Error as error:
            assert isinstance(query_error(error), StageRefused), sql
    try:
        con.sql("SELECT 'abc'::INTEGER").fetchall()
    except duckdb.Error as error:
        mapped = query_error(error)
        assert type(mapped) is QueryError and "abc" in str(mapped)
