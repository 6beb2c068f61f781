"""A Hypothesis state machine of inserts, DELETEs, UPDATEs and queries against DuckDB on the
same rows, on a cluster whose units move, split and merge between the steps, and whose
workers restart. Every answer and every count of changed rows must be DuckDB's. In
process: real workers, DuckDB and files on three nodes."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import duckdb
import pyarrow as pa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shardflow.errors import MoveRefusedError
from shardflow.sql.statements import ChangeRows, statement_of
from tests.support.local_cluster import LocalCluster

SUMMARY = (
    "SELECT count(*) AS n, sum(id) AS ids, sum(n) AS ns, sum(hash(name) % 1000003) AS names FROM t"
)


def rows(start: int, count: int) -> pa.Table:
    ids = list(range(start, start + count))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"r{i}" for i in ids]),
            "n": pa.array([i % 13 for i in ids], pa.int64()),
        }
    )


class ChangesAgainstDuckDB(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="shardflow-machine-"))
        self.cluster = LocalCluster(self.folder / "data", nodes=3)
        self.oracle = duckdb.connect()
        self.next_id = 0

    @initialize()
    def make(self) -> None:
        first = rows(0, 400)
        self.cluster.create_table("t", first, "id")
        self.oracle.execute("CREATE TABLE t AS SELECT * FROM first")
        self.next_id = 400

    def both(self, sql: str) -> None:
        """Run a DELETE or UPDATE on both; the counts of changed rows must match."""
        change = statement_of(sql)
        assert isinstance(change, ChangeRows)
        changed = self.cluster.session.change_rows(change)[0]
        expected = self.oracle.execute(sql).fetchall()[0][0]
        assert changed == expected, sql

    @rule(count=st.integers(1, 60))
    def insert(self, count: int) -> None:
        added = rows(self.next_id, count)
        self.next_id += count
        self.cluster.insert("t", added)
        self.oracle.execute("INSERT INTO t SELECT * FROM added")

    @rule(mod=st.integers(2, 9), rest=st.integers(0, 8))
    def delete(self, mod: int, rest: int) -> None:
        self.both(f"DELETE FROM t WHERE id % {mod} = {rest % mod}")

    @rule(low=st.integers(0, 600), width=st.integers(0, 120))
    def delete_range(self, low: int, width: int) -> None:
        self.both(f"DELETE FROM t WHERE id BETWEEN {low} AND {low + width}")

    @rule(mod=st.integers(2, 7), rest=st.integers(0, 6), step=st.integers(-3, 3))
    def update(self, mod: int, rest: int, step: int) -> None:
        self.both(
            f"UPDATE t SET n = n + ({step}), name = name || 'u' WHERE n % {mod} = {rest % mod}"
        )

    @rule(pick=st.integers(0, 1 << 16), to=st.integers(0, 2))
    def move(self, pick: int, to: int) -> None:
        units = self.cluster.units("t")
        unit = units[pick % len(units)]
        node = f"node-{to}"
        if node != unit.node:
            self.cluster.migrate(unit.unit_id, node)

    @rule(pick=st.integers(0, 1 << 16))
    def split(self, pick: int) -> None:
        units = self.cluster.units("t")
        if len(units) < 8:
            self.cluster.split(units[pick % len(units)].unit_id)

    @rule(pick=st.integers(0, 1 << 16))
    def merge(self, pick: int) -> None:
        units = sorted(self.cluster.units("t"), key=lambda u: u.lo)
        if len(units) > 2:
            i = pick % (len(units) - 1)
            try:
                self.cluster.merge(units[i].unit_id, units[i + 1].unit_id)
            except MoveRefusedError:
                pass  # on two nodes: not merged, as the cluster says

    @rule(to=st.integers(0, 2))
    def restart(self, to: int) -> None:
        self.cluster.restart(f"node-{to}")

    @invariant()
    def answers_as_duckdb(self) -> None:
        if self.next_id:
            got = self.cluster.sql(SUMMARY).to_pylist()
            assert got == self.oracle.sql(SUMMARY).to_arrow_table().to_pylist()

    def teardown(self) -> None:
        self.cluster.close()
        self.oracle.close()
        shutil.rmtree(self.folder, ignore_errors=True)


ChangesAgainstDuckDB.TestCase.settings = settings(
    max_examples=6,
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_changes_answer_as_duckdb_while_units_move = ChangesAgainstDuckDB.TestCase
