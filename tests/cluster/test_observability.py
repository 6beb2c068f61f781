"""Telemetry and metrics on a real cluster: device profiles and calibration, simulated slow
devices getting proportionally less, and a real Prometheus server scraping the coordinator."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

import shardflow

pytestmark = pytest.mark.cluster
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "shardflow-dashboard.json"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """The Debian package's Prometheus, installed here when it is missing."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("prometheus is not installed and cannot be (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:  # the package lists may be missing on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = shutil.which("prometheus")
    assert found, "the prometheus package did not install a prometheus binary"
    return found


@pytest.fixture
def prometheus(prometheus_binary: str, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A function that starts Prometheus scraping a target; yields (config, API base)."""
    port = free_port()
    yield tmp_path / "prometheus.yml", f"http://127.0.0.1:{port}"


def start_prometheus(binary: str, config: Path, api: str, target: str) -> subprocess.Popen[bytes]:
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: shardflow\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    listen = api.removeprefix("http://")
    return subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={config.parent / 'tsdb'}",
            f"--web.listen-address={listen}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def promql(api: str, query: str) -> list[dict[str, object]]:
    url = f"{api}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        payload = json.loads(response.read())
    assert payload["status"] == "success", payload
    return list(payload["data"]["result"])


def test_prometheus_scrapes_the_coordinator(
    prometheus: tuple[Path, str], prometheus_binary: str, tmp_path: Path
) -> None:
    config, api = prometheus
    with shardflow.connect(
        workers=2, initial_shard_bytes=0, data_dir=tmp_path / "data", auto_balance=False
    ) as db:
        db.create_table("t", pa.table({"id": list(range(1000))}), distributed_by="id")
        url = db.cluster.metrics_url()
        assert url.startswith("http://127.0.0.1:")
        target = url.removeprefix("http://").removesuffix("/metrics")
        server = start_prometheus(prometheus_binary, config, api, target)
        try:
            rate: list[dict[str, object]] = []
            deadline = time.monotonic() + 60
            while not rate and time.monotonic() < deadline:
                for _ in range(10):
                    db.sql("SELECT count(*) FROM t")
                db.insert("t", pa.table({"id": [5000]}))
                time.sleep(0.5)
                try:
                    rate = [
                        r
                        for r in promql(api, "rate(shardflow_queries_total[10s])")
                        if float(r["value"][1]) > 0  # type: ignore[index]
                    ]
                except OSError:
                    continue  # Prometheus is still starting
            assert rate, "Prometheus never saw a query rate"
            nodes = promql(api, "shardflow_nodes")
            assert nodes and float(nodes[0]["value"][1]) == 2  # type: ignore[index]
        finally:
            server.terminate()
            server.wait(timeout=30)
        # every metric the dashboard plots is one the coordinator serves
        with urllib.request.urlopen(url, timeout=5) as response:
            served = response.read().decode()
        plotted = set()
        for panel in json.loads(DASHBOARD.read_text())["panels"]:
            for target_expr in panel["targets"]:
                plotted |= set(re.findall(r"shardflow_[a-z_]+", target_expr["expr"]))
        for metric in plotted:
            base = re.sub(r"_(bucket|total)$", "", metric)
            assert base in served, f"the dashboard plots {metric}, which is not served"


def test_profiles_calibration_and_simulated_slow_nodes(tmp_path: Path) -> None:
    """Capacities 1, 1 and 0.5: the slow node holds about a fifth of the shards."""
    with shardflow.connect(
        workers=3,
        initial_shard_bytes=0,
        data_dir=tmp_path / "data",
        simulate={"node-2": 2.0},
        auto_balance=False,
        shards_per_worker=10,
    ) as db:
        nodes = {n.node_id: n for n in db.cluster.nodes()}
        assert nodes["node-2"].simulated and "simulated" in nodes["node-2"].model
        assert "simulated" in nodes["node-2"].engine
        assert not nodes["node-0"].simulated and nodes["node-0"].vendor == "cpu"
        for node in nodes.values():
            assert set(node.calibration) == {"scan_filter", "hash_aggregate", "hash_join", "sort"}
            assert node.memory_used_bytes > 0 and node.memory_free_bytes > 0
            assert node.device_utilization is None  # a CPU node has no device telemetry
            assert node.device_memory_used_bytes is node.device_memory_free_bytes is None
        assert nodes["node-0"].capacity == nodes["node-1"].capacity == 1.0  # the median node
        ratio = nodes["node-2"].capacity / nodes["node-0"].capacity
        assert 0.3 < ratio < 0.7  # measured (noisily, on a shared machine): it really is slower
        db.create_table("t", pa.table({"id": list(range(30_000))}), distributed_by="id")
        held = {n.node_id: n.shards for n in db.cluster.nodes()}
        assert sum(held.values()) == 30
        assert 4 <= held["node-2"] <= 8  # about a fifth
        assert abs(held["node-0"] - held["node-1"]) <= 2


def test_a_slow_node_is_judged_by_its_work_not_by_its_seconds(tmp_path: Path) -> None:
    """Under an even query load the simulated x2 slower node spends about twice the seconds
    per shard. The balancer counts them in the median node's seconds, so it sees the
    placement by capacity as balanced instead of taking the slow node's long seconds
    against its small capacity a second time (which made a spread above 200 %)."""
    with shardflow.connect(
        workers=3,
        initial_shard_bytes=0,
        data_dir=tmp_path / "data",
        simulate={"node-2": 2.0},
        auto_balance=False,
        balance_interval_s=60,  # the test takes the windows itself
        shards_per_worker=4,
    ) as db:
        ids = pa.array(range(2_000_000), pa.int64())
        db.create_table("t", pa.table({"id": ids, "v": ids}), distributed_by="id")
        stop = threading.Event()

        def query() -> None:
            while not stop.is_set():
                db.sql("SELECT v % 13 AS k, sum(v) FROM t GROUP BY k")

        readers = [threading.Thread(target=query) for _ in range(2)]
        for reader in readers:
            reader.start()
        try:
            db.cluster.rebalance(dry_run=True)  # opens the first window
            decisions = []
            for _ in range(4):
                time.sleep(2.0)
                decisions.append(db.cluster.rebalance(dry_run=True))
        finally:
            stop.set()
            for reader in readers:
                reader.join(timeout=60)
        assert {d["measure"] for d in decisions} == {"load"}, decisions
        spread = statistics.median(d["spread"] for d in decisions)
        assert spread < 0.45, [d["spread"] for d in decisions]  # measured 0.17-0.31


def test_workers_can_run_the_polars_engine(tpch_tiny: Path, tmp_path: Path) -> None:
    """engine="polars" (what NVIDIA nodes run, here on the CPU) gives DuckDB's answers."""
    from shardflow import tpch
    from tests.support.oracle import assert_same_result, query_is_ordered, sort_key_indexes

    oracle = tpch.duckdb_oracle(tpch_tiny)
    with shardflow.connect(
        workers=2,
        initial_shard_bytes=0,
        data_dir=tmp_path / "data",
        engine="polars",
        auto_balance=False,
    ) as db:
        tpch.load(db, tpch_tiny)
        assert {n.engine for n in db.cluster.nodes()} == {"polars"}
        for number in (1, 3, 13, 18, 21):
            sql = tpch.query(number)
            expected = oracle.sql(sql).to_arrow_table()
            result, profile = db.profile(sql)
            assert_same_result(
                result,
                expected,
                ordered=query_is_ordered(sql),
                sort_keys=sort_key_indexes(sql, expected.column_names),
            )
            assert result.schema.equals(expected.schema)  # DuckDB's names and types
            engines = {f.engine for stage in profile.stages for f in stage.fragments}
            assert engines == {"polars"}, engines


def test_shards_report_their_load(tmp_path: Path) -> None:
    """The load the balancer sees per shard: queried shards carry it, idle ones do not.
    (That it is null before a window was observed is checked where no window can pass:
    tests/cluster/test_routing.py, an hour's interval; at 0.5 s here one may pass while the
    tables load.)"""
    with shardflow.connect(
        workers=2,
        initial_shard_bytes=0,
        data_dir=tmp_path / "data",
        auto_balance=False,
        balance_interval_s=0.5,
    ) as db:
        db.create_table("busy", pa.table({"id": list(range(20_000))}), distributed_by="id")
        db.create_table("idle", pa.table({"id": list(range(20_000))}), distributed_by="id")
        deadline = time.monotonic() + 30
        loads: dict[str, list[float]] = {}
        while time.monotonic() < deadline:
            for _ in range(20):
                db.sql("SELECT id % 7 AS k, count(*) FROM busy GROUP BY k")
            shards = db.cluster.shards().to_pylist()
            loads = {
                table: [s["load"] for s in shards if s["table"] == table and s["load"] is not None]
                for table in ("busy", "idle")
            }
            if loads["busy"] and min(loads["busy"]) > 0:
                break
        assert loads["busy"] and min(loads["busy"]) > 0, loads
        assert loads["idle"] and max(loads["idle"]) == 0, loads
        # the nodes' busy fraction over the same window
        assert all(n.utilization is not None and n.utilization > 0 for n in db.cluster.nodes())
