"""Routed queries on a real cluster: a point lookup on the distribution key runs on the one
worker owning the key, and keeps answering right while that very shard moves (a table with a
key index: the target of the move builds it too)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

import shardflow
from shardflow.catalog.buckets import bucket_of
from tests.cluster.conftest import sigkill_worker, wait_for_failover

pytestmark = pytest.mark.cluster
KEY = 4242


def events(start: int, count: int) -> pa.Table:
    ids = pa.array(range(start, start + count), pa.int64())
    return pa.table({"id": ids, "g": pa.array([i % 13 for i in range(start, start + count)]),
                     "pad": pa.array(["x" * 100] * count)})  # fmt: skip


def owner_of(db: shardflow.Database, key: int) -> dict[str, object]:
    n_buckets = db._session_or_raise().catalog.n_buckets
    bucket = int(bucket_of(pa.array([key], pa.int64()), n_buckets)[0])
    for shard in db.cluster.shards().to_pylist():
        if shard["table"] == "events" and shard["bucket_lo"] <= bucket < shard["bucket_hi"]:
            return shard
    raise AssertionError(f"no shard owns bucket {bucket}")


def test_a_point_lookup_is_routed_and_follows_a_move_in_flight(tmp_path: Path) -> None:
    with shardflow.connect(
        workers=3,
        initial_shard_bytes=0,
        data_dir=tmp_path,
        test_hold_copy_s=3,  # the move stays in flight while lookups run
        balance_interval_s=3600,
    ) as db:
        db.create_table("events", events(0, 60_000), distributed_by="id", key_index=True)
        assert db.tables().column("key_index").to_pylist() == [True]
        shards = db.cluster.shards()  # no balancer window observed within the hour: no load
        assert shards.num_rows == 3 and shards.column("load").null_count == 3
        owner = owner_of(db, KEY)
        lookup = f"SELECT id, g FROM events WHERE id = {KEY}"
        assert f"router: 1 shard ({owner['node']})" in db.explain(lookup)
        assert db.sql(lookup).to_pylist() == [{"id": KEY, "g": KEY % 13}]
        assert {f.worker for s in db.last_report.stages for f in s.fragments} == {owner["node"]}

        target = next(n.node_id for n in db.cluster.nodes() if n.node_id != owner["node"])
        outcome: list[object] = []
        mover = threading.Thread(
            target=lambda: outcome.append(db.cluster.migrate(str(owner["shard"]), to=target))
        )
        mover.start()
        during, added = 0, []
        while mover.is_alive():  # lookups and inserts on the moving shard's keys
            assert db.sql(lookup).to_pylist() == [{"id": KEY, "g": KEY % 13}]
            new_key = 1_000_000 + during
            db.insert("events", events(new_key, 1))
            added.append(new_key)
            found = db.sql(f"SELECT count(*) AS n FROM events WHERE id IN ({KEY}, {new_key})")
            assert found["n"][0].as_py() == 2
            during += 1
            time.sleep(0.05)
        mover.join()
        assert during >= 3, "the move ended before the lookups could overlap it"
        assert getattr(outcome[0], "phase", None) == "done"
        assert f"router: 1 shard ({target})" in db.explain(lookup)
        moved = owner_of(db, KEY)  # the target built the index as it copied
        assert moved["node"] == target and moved["indexed"] is True
        assert all(db.cluster.shards().column("indexed").to_pylist())

        oracle = duckdb.connect()
        oracle.register(
            "events", pa.concat_tables([events(0, 60_000)] + [events(k, 1) for k in added])
        )
        for sql in (
            lookup,
            f"SELECT g, count(*) AS n FROM events WHERE id IN (1, 2, {KEY}, 59999) GROUP BY g",
            f"SELECT count(*) AS n FROM events WHERE id IN ({', '.join(map(str, added))})",
            "SELECT count(*) AS n, sum(id) AS s FROM events",
        ):
            got = sorted(db.sql(sql).to_pylist(), key=repr)
            assert got == sorted(oracle.sql(sql).to_arrow_table().to_pylist(), key=repr), sql


def lookups_via(db: shardflow.Database, sql: str) -> set[str]:
    _, profile = db.profile(sql)
    return {f.via for stage in profile.stages for f in stage.fragments}


def test_routed_lookups_take_the_fast_lane_and_survive_its_worker_killed(tmp_path: Path) -> None:
    """A lookup routed to one worker is asked over the session's own connection to it; when
    that worker is SIGKILLed, the lane breaks, Ray says the worker is gone, its shards fail
    over, and no lookup fails or answers wrong meanwhile."""
    with shardflow.connect(
        workers=3, initial_shard_bytes=0, data_dir=tmp_path, balance_interval_s=3600
    ) as db:
        db.create_table("events", events(0, 30_000), distributed_by="id")
        lookup = f"SELECT id, g FROM events WHERE id = {KEY}"
        assert lookups_via(db, lookup) == {"fast lane"}
        _, counted = db.profile("SELECT count(*) FROM events")  # every worker, merged here
        assert {(f.worker, f.via) for f in counted.stages[0].fragments} == {
            (f"node-{i}", "fast lane") for i in range(3)
        }
        assert "via fast lane" in db.profile(lookup)[1].text()
        db.create_table("kinds", pa.table({"g": range(13), "name": [f"k{i}" for i in range(13)]}),
                        replicated=True)  # fmt: skip
        assert lookups_via(db, "SELECT count(*) FROM kinds") == {"fast lane"}  # one worker
        # a second stage reads what the client merged of the first: sent along on the lanes
        above = "SELECT count(*) AS n FROM events WHERE id > (SELECT avg(id) FROM events)"
        assert db.sql(above).to_pylist() == [{"n": 15_000}]
        assert len(db.profile(above)[1].stages) == 2
        assert lookups_via(db, above) == {"fast lane"}
        victim = str(owner_of(db, KEY)["node"])
        failures: list[BaseException] = []
        answers: list[object] = []
        stop = threading.Event()

        def reader() -> None:
            i = 0
            while not stop.is_set():
                key = KEY if i % 2 == 0 else 17 + i % 29_000
                try:
                    if i % 5 == 4:  # every worker's lane at once
                        got = db.sql("SELECT count(*) AS n FROM events").to_pylist()
                        answers.append(got == [{"n": 30_000}] or got)
                        continue
                    got = db.sql(f"SELECT id, g FROM events WHERE id = {key}").to_pylist()
                    answers.append(got == [{"id": key, "g": key % 13}] or (key, got))
                except BaseException as error:  # the assertion below reports it
                    failures.append(error)
                finally:
                    i += 1

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            time.sleep(0.5)
            before = len(answers)
            sigkill_worker(db, victim)
            wait_for_failover(db)
            time.sleep(1)
        finally:
            stop.set()
            thread.join(timeout=120)
        assert not failures, failures[:3]
        assert len(answers) > before + 10, "no lookup ran across the kill"
        assert all(a is True for a in answers), [a for a in answers if a is not True][:3]
        assert db.cluster.failovers()[0]["node"] == victim
        assert lookups_via(db, lookup) == {"fast lane"}  # the new owner's lane


def test_without_the_fast_lane_everything_goes_through_ray(tmp_path: Path) -> None:
    with shardflow.connect(
        workers=2, initial_shard_bytes=0, data_dir=tmp_path, fast_lane=False
    ) as db:
        db.create_table("events", events(0, 1_000), distributed_by="id")
        lookup = f"SELECT id, g FROM events WHERE id = {KEY % 1_000}"
        assert lookups_via(db, lookup) == {"ray"}
        assert db.sql(lookup).to_pylist() == [{"id": KEY % 1_000, "g": KEY % 1_000 % 13}]


def test_a_table_on_one_worker_answers_whole_there_and_is_planned_again_once_it_spreads(
    tmp_path: Path,
) -> None:
    """A table small enough to be one shard runs each query as written on its worker, in
    one fragment. A session that planned so before the shard was split and half of it
    moved (it had not heard yet) must not concatenate two workers' whole answers: it plans
    the query again over the shards as they are."""
    rows = events(0, 20_000)
    query = "SELECT g, count(*) AS n, sum(id) AS s FROM events GROUP BY g ORDER BY g"
    expected = duckdb.sql(query.replace("events", "rows")).to_arrow_table().to_pylist()
    with shardflow.connect(workers=2, data_dir=tmp_path / "data", auto_balance=False) as db:
        db.create_table("events", rows, distributed_by="id")
        assert "whole query on the worker of its shards" in db.explain(query)
        assert db.sql(query).to_pylist() == expected
        session = db._session_or_raise()
        planned_on = session.catalog
        (shard,) = [s for s in db.cluster.shards().to_pylist() if s["table"] == "events"]
        db.cluster.split(str(shard["shard"]))
        half = next(s for s in db.cluster.shards().to_pylist() if s["table"] == "events")
        other = next(n for n in ("node-0", "node-1") if n != half["node"])
        db.cluster.migrate(str(half["shard"]), to=other)
        session.catalog = planned_on  # as a session that has not heard of the moves yet
        assert db.sql(query).to_pylist() == expected
        assert "whole query" not in db.explain(query)
        report = db.last_report
        assert report is not None and report.replans == 1
        assert len(report.stages[0].fragments) == 2


def test_a_query_planned_whole_stays_right_when_its_worker_is_killed(tmp_path: Path) -> None:
    """The worker holding both halves of a split one-shard table is SIGKILLed; the next
    query, planned whole on it, finds its shards failed over to the two other workers."""
    rows = events(0, 20_000)
    query = "SELECT g, count(*) AS n, sum(id) AS s FROM events GROUP BY g ORDER BY g"
    expected = duckdb.sql(query.replace("events", "rows")).to_arrow_table().to_pylist()
    with shardflow.connect(workers=3, data_dir=tmp_path / "data", auto_balance=False) as db:
        db.create_table("events", rows, distributed_by="id")
        (shard,) = [s for s in db.cluster.shards().to_pylist() if s["table"] == "events"]
        db.cluster.split(str(shard["shard"]))  # both halves stay on the shard's worker
        assert "whole query on the worker of its shards" in db.explain(query)
        assert db.sql(query).to_pylist() == expected
        sigkill_worker(db, str(shard["node"]))
        assert db.sql(query).to_pylist() == expected
        wait_for_failover(db)
        owners = {s["node"] for s in db.cluster.shards().to_pylist() if s["table"] == "events"}
        assert owners == {"node-0", "node-1", "node-2"} - {shard["node"]}
        assert db.last_report is not None and db.last_report.replans == 1
