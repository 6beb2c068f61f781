"""A newcomer's first hour with the ``shardflow`` command, each step run as a user types it
(a real process each time, its exit code and output checked): looking never moves data,
mistakes are said at once in one line, and what the README promises is there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.cluster
SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDFLOW, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def rows(*args: str) -> list[dict[str, object]]:
    done = run(*args, "--format", "json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def one_line_error(done: subprocess.CompletedProcess[str], *said: str) -> None:
    """Exit code 2 and one readable line that says it (no traceback)."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stdout + done.stderr
    for words in said:
        assert words in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr


def test_commands_that_only_look_never_move_a_shard_and_tables_are_emptied_and_dropped(
    tmp_path: Path,
) -> None:
    """The issue's steps: a shard moved by hand stays where it was put through `tables`,
    `explain`, `sql` and `cluster nodes` (each starts the cluster the data directory last
    had, under the same node ids, not one worker that takes everything). Then tables are
    listed for scripts, emptied by `sql "TRUNCATE ..."` and dropped by `drop` (one data
    directory: every command starts its cluster, seconds each)."""
    pq.write_table(pa.table({"id": list(range(4000))}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"code": ["a", "b"]}), tmp_path / "codes.parquet")
    data = ("--data-dir", str(tmp_path / "cli"))
    loaded = run("load", "t", str(tmp_path / "t.parquet"), "--distributed-by", "id",
                 "--workers", "2", *data)  # fmt: skip
    assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-2000:]
    first = loaded.stdout.splitlines()[0]  # said before the cluster starts and the rows load
    assert first.startswith("loading t from") and "(4,000 rows)" in first, loaded.stdout
    codes = run("load", "codes", str(tmp_path / "codes.parquet"), "--replicated", *data)
    assert codes.returncode == 0, codes.stdout[-2000:] + codes.stderr[-2000:]
    shards = rows("cluster", "shards", *data)
    [shard] = [s for s in shards if s["table"] == "t"]
    target = "node-1" if shard["node"] == "node-0" else "node-0"
    moved = run("cluster", "migrate", str(shard["shard"]), target, *data)
    assert moved.returncode == 0 and "done" in moved.stdout, moved.stdout[-2000:]

    for look in (
        ("explain", "SELECT count(*) FROM t", *data),
        ("sql", "SELECT count(*) AS n FROM t", *data),
        ("cluster", "nodes", *data),
        ("cluster", "rebalance", *data),
    ):
        done = run(*look)
        assert done.returncode == 0, (look, done.stdout[-2000:] + done.stderr[-2000:])
    listed = {row["name"]: row for row in rows("tables", *data)}
    assert listed["codes"]["kind"] == "replicated" and listed["codes"]["rows"] == 2
    copies = [s for s in shards if s["table"] == "codes"]
    assert listed["codes"]["shards"] == len(copies) == 2  # as cluster shards lists them
    # a look that started fewer workers would have placed the shard again on those it had
    placed = {s["shard"]: s["node"] for s in rows("cluster", "shards", *data)}
    assert placed[shard["shard"]] == target, placed
    assert [n["node"] for n in rows("cluster", "nodes", *data)] == ["node-0", "node-1"]

    dropped = run("drop", "t", *data)
    assert dropped.returncode == 0 and "dropped t" in dropped.stdout, dropped.stdout
    assert rows("sql", "TRUNCATE codes", *data) == [{"count": 2}]  # the rows it emptied
    assert [(row["name"], row["rows"]) for row in rows("tables", *data)] == [("codes", 0)]
    one_line_error(run("drop", "t", *data), "UnknownTableError")


def test_mistakes_are_said_at_once_and_nothing_starts(tmp_path: Path) -> None:
    typo = tmp_path / "cil"
    one_line_error(run("sql", "SELECT 1", "--data-dir", str(typo)), "holds no shardflow data")
    one_line_error(run("tables", "--data-dir", str(typo)), str(typo))
    assert not typo.exists(), "a typo made a data directory"
    data = tmp_path / "new"
    missing = run("load", "t", str(tmp_path / "nope.parquet"), "--data-dir", str(data))
    one_line_error(missing, "TableError", "does not exist")
    assert not data.exists(), "a cluster started before the source was checked"


def test_cluster_nodes_fits_a_terminal_of_150_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": list(range(100))}), tmp_path / "t.parquet")
    data = ("--data-dir", str(tmp_path / "d"))
    done = run("load", "t", str(tmp_path / "t.parquet"), "--workers", "3", *data)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shown = run("cluster", "nodes", *data, env={"COLUMNS": "150"})
    assert shown.returncode == 0, shown.stdout[-2000:]
    lines = shown.stdout.splitlines()
    assert lines and all(len(line) <= 150 for line in lines), shown.stdout
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == 3, shown.stdout  # one line a node, none wrapped
    assert all("node-" in line for line in body[1:])


def test_a_local_cluster_says_what_it_starts_and_keeps_its_last_data_node(
    tmp_path: Path,
) -> None:
    data = ("--data-dir", str(tmp_path / "sf-cluster"))
    up = run("cluster", "up", "--nodes", "2", "--object-store-mb", "128", *data)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        said = up.stdout.splitlines()
        assert said[0].startswith("starting a head and 2 data node(s)"), said  # at once
        started = [line.split()[2] for line in said if "Ray node" in line and "started" in line]
        assert started == ["head", "ray-1", "ray-2"], said  # each as it comes up
        killed = run("cluster", "remove-node", "ray-2", "--kill", *data)
        assert killed.returncode == 0, killed.stdout[-2000:] + killed.stderr[-2000:]
        status = run("cluster", "status", *data)
        assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
        assert "\x1b[" not in status.stdout + status.stderr, status.stdout  # no colour codes
        assert "A worker died" not in status.stdout, "Ray's messages on standard output"
        last = run("cluster", "remove-node", "ray-1", *data)
        one_line_error(last, "MoveRefusedError", "last data node", "nowhere to go")
        assert "ray-1" in run("cluster", "status", *data).stdout  # still there
    finally:
        run("cluster", "down", *data)


def test_a_busy_port_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = tmp_path / "svc"
        done = run("serve", "--data-dir", str(data), "--flight-port", str(port))
    one_line_error(done, "ConfigError", f"127.0.0.1:{port} is in use", "--flight-port")
    assert not data.exists(), "a cluster started before the port was checked"


def test_the_help_names_the_operators_extra() -> None:
    shown = run("--help", env={"COLUMNS": "200"})
    assert shown.returncode == 0 and "pip install 'shardflow[k8s]'" in shown.stdout, shown.stdout
