"""Shard pruning: a query whose rows all carry given values of the distribution key runs
only on the shards owning those values' buckets, and answers exactly what DuckDB answers;
anything less certain scatters to every shard as before."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from shardflow.catalog.buckets import bucket_of
from shardflow.catalog.model import Group, Unit
from shardflow.sql import plan
from shardflow.sql.explain import explain
from tests.support.inmemory import InMemoryCluster
from tests.support.oracle import assert_same_result

ORDERS = pa.table(
    {
        "k": pa.array(range(2000), pa.int64()),
        "v": [i % 10 for i in range(2000)],
        "s": [f"s{i % 37}" for i in range(2000)],
    }
)
LINES = pa.table({"lk": pa.array([i % 2000 for i in range(6000)], pa.int32()), "q": range(6000)})
NATIONS = pa.table({"n": range(10), "name": [f"n{i}" for i in range(10)]})


@pytest.fixture(scope="module")
def routed() -> tuple[InMemoryCluster, duckdb.DuckDBPyConnection]:
    cluster = InMemoryCluster(nodes=3, units_per_node=3)
    cluster.create_table("o", ORDERS, distributed_by="k")
    cluster.create_table("l", LINES, distributed_by="lk", colocate_with="o")
    cluster.create_table("by_name", ORDERS, distributed_by="s")
    cluster.create_table("nation", NATIONS, replicated=True)
    oracle = duckdb.connect()
    for name, table in (("o", ORDERS), ("l", LINES), ("by_name", ORDERS), ("nation", NATIONS)):
        oracle.register(name, table)
    return cluster, oracle


ROUTED = [
    ("SELECT * FROM o WHERE k = 42", [42]),
    ("SELECT * FROM o WHERE k IN (1, 2, 1999)", [1, 2, 1999]),
    ("SELECT count(*), sum(v) FROM o WHERE k = 5 AND v > 0", [5]),
    ("SELECT count(*) FROM o WHERE k = 5000", [5000]),  # no such row: still one shard, 0
    ("SELECT o.k, sum(l.q) FROM o JOIN l ON o.k = l.lk WHERE o.k = 7 GROUP BY o.k", [7]),
    ("SELECT * FROM o LEFT JOIN l ON o.k = l.lk WHERE l.lk = 3", [3]),
    ("SELECT v, count(*) FROM o WHERE k IN (1, 2, 3, 4, 5) GROUP BY v ORDER BY v", [1, 2, 3, 4, 5]),
    ("SELECT * FROM o WHERE k = 42 ORDER BY v LIMIT 1", [42]),
    ("SELECT o.k, nation.name FROM o JOIN nation ON o.v = nation.n WHERE o.k = 11", [11]),
    ("SELECT * FROM o WHERE 42 = k AND (k = 42)", [42]),
]
SCATTERED = [
    "SELECT * FROM o WHERE k = 42 OR k = 43",  # OR: either side may hold rows
    "SELECT * FROM o WHERE k + 1 = 43",  # an expression of the key
    "SELECT * FROM o WHERE k = '42'",  # a string for an integer key: DuckDB's cast decides
    "SELECT * FROM o WHERE v = 3",  # not the key
    "SELECT * FROM o WHERE k IN (SELECT n FROM nation)",  # not constants
    "SELECT * FROM (SELECT * FROM o) AS sub WHERE sub.k = 42",  # not the table itself
    "SELECT * FROM o WHERE NOT k = 42",
]


@pytest.mark.parametrize(("sql", "keys"), ROUTED)
def test_routed_queries_run_on_the_owning_shards_only_and_answer_like_duckdb(
    sql: str, keys: list[int], routed: tuple[InMemoryCluster, duckdb.DuckDBPyConnection]
) -> None:
    cluster, oracle = routed
    planned = plan(sql, cluster.catalog)
    scattered = [s for s in planned.stages if s.placement == "shards"]
    expected_buckets = {
        int(b) for b in bucket_of(pa.array(keys, pa.int64()), cluster.catalog.n_buckets)
    }
    assert [set(s.buckets or ()) for s in scattered] == [expected_buckets] * len(scattered)
    group = cluster.catalog.groups[scattered[0].group or ""]
    assert len(scattered[0].units_to_run(group)) < len(group.units)
    assert_same_result(cluster.sql(sql), oracle.sql(sql).to_arrow_table(), ordered=False)


@pytest.mark.parametrize("sql", SCATTERED)
def test_anything_less_certain_scatters_to_every_shard(
    sql: str, routed: tuple[InMemoryCluster, duckdb.DuckDBPyConnection]
) -> None:
    cluster, oracle = routed
    planned = plan(sql, cluster.catalog)
    assert all(s.buckets is None for s in planned.stages)
    assert_same_result(cluster.sql(sql), oracle.sql(sql).to_arrow_table(), ordered=False)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM o WHERE k = 2 AND k = 4",
        "SELECT count(*), sum(v) FROM o WHERE k = 2 AND k IN (3, 4)",
        "SELECT v, count(*) FROM o WHERE k IN (1, 2) AND k IN (2, 3) GROUP BY v",
        "SELECT * FROM by_name WHERE s = 'hello' AND s = 'world'",
    ],
)
def test_contradictory_or_overlapping_key_conditions_still_answer(
    sql: str, routed: tuple[InMemoryCluster, duckdb.DuckDBPyConnection]
) -> None:
    """Found by DuckDB's own tests: ``a = 2 AND a = 4`` leaves no bucket; one shard must
    still run to give the empty answer (or the aggregate of nothing)."""
    cluster, oracle = routed
    stages = [s for s in plan(sql, cluster.catalog).stages if s.placement == "shards"]
    assert all(s.buckets is not None and len(s.buckets) >= 1 for s in stages)
    assert_same_result(cluster.sql(sql), oracle.sql(sql).to_arrow_table(), ordered=False)


def test_string_keys_are_routed_and_explain_names_the_shard(
    routed: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    cluster, oracle = routed
    sql = "SELECT count(*) AS n FROM by_name WHERE s = 's5'"
    planned = plan(sql, cluster.catalog)
    stage = next(s for s in planned.stages if s.placement == "shards")
    units = stage.units_to_run(cluster.catalog.groups[stage.group or ""])
    assert len(units) == 1
    assert f"router: 1 shard ({units[0].node})" in explain(planned, cluster.catalog)
    assert_same_result(cluster.sql(sql), oracle.sql(sql).to_arrow_table(), ordered=False)


def test_a_routed_stage_follows_the_units_that_own_its_buckets_now(
    routed: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    """Routing is by bucket, not by unit: a plan made before a split still finds the
    rows in whichever unit owns their bucket afterwards."""
    cluster, _ = routed
    stage = next(s for s in plan("SELECT * FROM o WHERE k = 42", cluster.catalog).stages)
    group = cluster.catalog.groups[stage.group or ""]
    bucket = stage.buckets[0] if stage.buckets else -1
    owner = next(u for u in group.units if u.lo <= bucket < u.hi)
    middle = (owner.lo + owner.hi) // 2
    halves = (Unit(100, owner.lo, middle, owner.node), Unit(101, middle, owner.hi, "node-x"))
    others = tuple(u for u in group.units if u is not owner)
    split = Group(group.group_id, group.key_family, others + halves)
    chosen = stage.units_to_run(split)
    assert len(chosen) == 1 and chosen[0].lo <= bucket < chosen[0].hi
