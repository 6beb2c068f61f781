"""The ``shardflow`` command, run as users run it (a real process each time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHARDFLOW, *args], capture_output=True, text=True, timeout=600)


def summary_of(stdout: str) -> dict[str, float]:
    """The story's last line, ``queries=N failed=0 ...``, as numbers."""
    line = next(line for line in reversed(stdout.splitlines()) if line.startswith("queries="))
    return {k: float(v) for k, v in (part.split("=") for part in line.split())}


def test_demo_then_sql_on_its_data_directory(tmp_path: Path) -> None:
    demo = run(
        *("demo", "--sf", "0.01", "--workers", "2", "--repeat", "1", "--home", str(tmp_path)),
        *("--no-live", "--pace", "0.5"),
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "answers equal: 22/22" in demo.stdout
    assert "Q22" in demo.stdout and "geometric mean ratio" in demo.stdout
    assert "node-1" in demo.stdout and "duckdb" in demo.stdout  # the workers and engines
    # the live story, as plain lines: every step ran, the clients saw no failure
    for step in ("add two nodes", "migrate a shard by hand", "split a shard by hand"):
        assert step in demo.stdout
    assert "SIGKILL node-" in demo.stdout and "declared dead" in demo.stdout
    seen = summary_of(demo.stdout)
    assert seen["queries"] > 20 and seen["rows_acked"] > 0, seen
    assert seen["failed"] == seen["wrong"] == seen["rows_lost"] == seen["rows_duplicated"] == 0
    assert seen["moves_done"] >= 4 and seen["moves_rolled_back"] == 0, seen
    assert seen["recovery_s"] >= 0, "the SIGKILLed worker's shards were served again"

    data_dir = str(tmp_path / "db-sf0.01")
    sql = run("sql", "SELECT count(*) AS n FROM orders", "--data-dir", data_dir)
    assert sql.returncode == 0, sql.stderr[-3000:]
    assert "15000" in sql.stdout

    explain = run(
        "explain", "SELECT o_orderstatus, count(*) FROM orders GROUP BY 1", "--data-dir", data_dir
    )
    assert explain.returncode == 0 and "pushdown: full" in explain.stdout
    # split in two by the story: on two workers, or whole on one if both halves are there
    assert "partial aggregate" in explain.stdout or "whole query" in explain.stdout

    bad = run("sql", "SELECT * FROM nope", "--data-dir", data_dir)
    assert bad.returncode == 2
    assert "UnknownTableError" in bad.stdout


def test_help_lists_commands() -> None:
    shown = run("--help")
    assert shown.returncode == 0
    for command in ("demo", "sql", "explain", "tables", "load", "insert", "serve", "cluster"):
        assert command in shown.stdout


def test_from_a_parquet_file_to_a_query_with_the_command_alone(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(100)), "g": [i % 3 for i in range(100)]}),
                   tmp_path / "t.parquet")  # fmt: skip
    pq.write_table(pa.table({"id": [100, 101], "g": [0, 0]}), tmp_path / "more.parquet")
    data_dir = str(tmp_path / "data")
    common = ("--data-dir", data_dir)
    loaded = run(
        "load", "t", str(tmp_path / "t.parquet"), "--distributed-by", "id", "--key-index",
        "--workers", "1", *common,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-2000:]
    assert "loaded 100 rows into t" in loaded.stdout
    inserted = run("insert", "t", str(tmp_path / "more.parquet"), *common)
    assert inserted.returncode == 0 and "inserted 2 rows into t" in inserted.stdout
    answer = run("sql", "SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g", *common)
    assert answer.returncode == 0
    assert [line.split("│")[1:3] for line in answer.stdout.splitlines() if "│" in line] == [
        [" 0 ", " 36 "],
        [" 1 ", " 33 "],
        [" 2 ", " 33 "],
    ]
    query = "SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g"
    csv = run("sql", query, "--format", "csv", *common)
    assert csv.returncode == 0 and csv.stdout.split() == ['"g","n"', "0,36", "1,33", "2,33"]
    lines = run("sql", query, "--format", "json", *common).stdout.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"g": 0, "n": 36},
        {"g": 1, "n": 33},
        {"g": 2, "n": 33},
    ]
    arrow = subprocess.run(
        [SHARDFLOW, "sql", query, "--format", "arrow", *common], capture_output=True, timeout=600
    )
    assert pa.ipc.open_stream(arrow.stdout).read_all().to_pydict() == {
        "g": [0, 1, 2],
        "n": [36, 33, 33],
    }
    missing = run("load", "u", str(tmp_path / "nope.parquet"), *common)
    assert missing.returncode == 2 and "TableError" in missing.stdout
    assert len(missing.stdout.strip().splitlines()) <= 3  # one readable error, no traceback


def test_the_cluster_commands_attach_to_the_running_cluster_of_the_data_directory(
    tmp_path: Path,
) -> None:
    """With `shardflow cluster up` serving a data directory, every command attaches to it
    (no --address needed): load, nodes, shards, migrate, migrations, rebalance, drain and
    profile act on that one cluster."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data_dir = str(tmp_path / "data")
    common = ("--data-dir", data_dir)
    up = run("cluster", "up", "--nodes", "3", "--object-store-mb", "128", *common)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    try:
        pq.write_table(pa.table({"id": list(range(3000))}), tmp_path / "t.parquet")
        loaded = run("load", "t", str(tmp_path / "t.parquet"), "--distributed-by", "id", *common)
        assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-2000:]

        def rows(*args: str) -> list[dict[str, object]]:
            done = run("cluster", *args, "--format", "json", *common)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            return [json.loads(line) for line in done.stdout.splitlines()]

        nodes = rows("nodes")
        assert len(nodes) == 3 and all(n["health"] == "healthy" for n in nodes)
        assert {str(n["ray_node"]) for n in nodes} == {"ray-1", "ray-2", "ray-3"}  # attached
        shard = rows("shards")[0]
        target = next(str(n["node"]) for n in nodes if n["node"] != shard["node"])
        moved = run("cluster", "migrate", str(shard["shard"]), target, *common)
        assert moved.returncode == 0 and "done" in moved.stdout, moved.stdout[-2000:]
        assert {s["shard"]: s["node"] for s in rows("shards")}[shard["shard"]] == target
        history = rows("migrations")
        assert history[-1]["to"] == target and history[-1]["phase"] == "done"
        plan = run("cluster", "rebalance", *common)
        assert plan.returncode == 0 and "balanced by" in plan.stdout
        paused = run("cluster", "balancer", "pause", *common)
        assert paused.returncode == 0 and "paused" in paused.stdout, paused.stdout[-2000:]
        resumed = run("cluster", "balancer", "resume", *common)
        assert resumed.returncode == 0 and "the balancer runs" in resumed.stdout
        ended = run("cluster", "cancel", str(history[-1]["move"]), *common)
        assert ended.returncode == 2 and "ended already" in ended.stdout, ended.stdout[-2000:]
        drained = run("cluster", "drain", target, *common)
        assert drained.returncode == 0 and f"drained {target}" in drained.stdout
        assert target not in {n["node"] for n in rows("nodes")}
        page = tmp_path / "profile.html"
        profiled = run("profile", "SELECT count(*) FROM t", "--html", str(page), *common)
        assert (
            profiled.returncode == 0
            and "planning" in profiled.stdout
            and "1 rows" in (profiled.stdout)
        )
        assert 'id="axis"' in page.read_text()
        bad = run("cluster", "migrate", "t#999", target, *common)
        assert bad.returncode == 2 and len(bad.stdout.strip().splitlines()) <= 3
    finally:
        run("cluster", "down", *common)


def test_backup_list_verify_and_restore_with_the_command_alone(tmp_path: Path) -> None:
    from tests.support.local_cluster import LocalCluster, events

    made = LocalCluster(tmp_path / "data", nodes=2)
    made.create_table("events", events(0, 5000), "id")
    made.insert("events", events(5000, 100), "b0")
    made.close()
    data, backups = str(tmp_path / "data"), str(tmp_path / "backups")
    first = run("backup", "--data-dir", data, "--to", backups)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 tables" in first.stdout
    again = run("backup", "--data-dir", data, "--to", backups, "--priority", "low")
    assert again.returncode == 0 and "(0.0 MB new)" in again.stdout, again.stdout
    listed = run("backup", "list", backups)
    assert listed.returncode == 0 and listed.stdout.count("Z-") == 2  # two ids
    checked = run("backup", "verify", backups)
    assert checked.returncode == 0 and "checked: ok" in checked.stdout
    restored = run("restore", "--from", backups, "--data-dir", str(tmp_path / "new"))
    assert restored.returncode == 0 and "restored backup" in restored.stdout
    served = LocalCluster(tmp_path / "new", nodes=3)  # another cluster size
    try:
        assert served.sql("SELECT count(*) AS n FROM events").column("n")[0].as_py() == 5100
    finally:
        served.close()
    # bad input: one readable line each, and nothing written
    for args, said in (
        (("backup", "--data-dir", data), "--to"),
        (("backup", "--data-dir", data, "--to", backups, "--priority", "urgent"), "priority"),
        (("backup", "--data-dir", str(tmp_path / "none"), "--to", backups), "no shardflow data"),
        (("restore", "--from", backups, "--data-dir", data), "holds shardflow data already"),
        (("backup", "verify", str(tmp_path / "nowhere")), "does not exist"),
    ):
        refused = run(*args)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert said in refused.stdout + refused.stderr, (args, refused.stdout, refused.stderr)
    pack = next((tmp_path / "backups" / "packs").iterdir())
    damaged = bytearray(pack.read_bytes())
    damaged[100] ^= 0xFF
    pack.write_bytes(bytes(damaged))
    assert not (tmp_path / "none").exists()
    pruned = run("backup", "prune", backups, "--keep", "1")
    assert pruned.returncode == 0 and "removed 1 backup(s)" in pruned.stdout, pruned.stdout
    assert run("backup", "list", backups).stdout.count("Z-") == 1
    bad = run("backup", "verify", backups)
    assert bad.returncode == 1 and "does not match its checksum" in bad.stdout
