"""The ``shardflow`` command against a running service, as a user types it: every data
command takes ``--address grpc://...`` with ``--user`` (the password from the environment)
or ``--token``, and works as it does in process; without the address, the error says it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.service.conftest import PASSWORDS, SHARDFLOW, Served, shardflow_cli

pytestmark = pytest.mark.cluster


def as_user(user: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDFLOW, *args, "--user", user],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SHARDFLOW_PASSWORD": PASSWORDS[user]},
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def one_line_error(done: subprocess.CompletedProcess[str], *said: str) -> None:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stdout + done.stderr
    for words in said:
        assert words in lines[0], lines[0]


def test_the_data_commands_work_against_a_service(served: Served, tmp_path: Path) -> None:
    at = ("--address", served.uri)
    counted = ok(as_user("alice", "sql", "SELECT count(*) AS n FROM t", "--format", "json", *at))
    assert json.loads(counted) == {"n": 2000}
    assert "t" in {row["name"] for row in map(json.loads, ok(as_user(
        "alice", "tables", "--format", "json", *at)).splitlines())}  # fmt: skip
    assert "pushdown" in ok(as_user("alice", "explain", "SELECT count(*) FROM t", *at))
    profiled = ok(as_user("alice", "profile", "SELECT g, count(*) FROM t GROUP BY g", *at))
    assert "planning" in profiled and "7 rows" in profiled

    pq.write_table(pa.table({"k": list(range(50))}), tmp_path / "k.parquet")
    loaded = ok(as_user("bob", "load", "remote_k", str(tmp_path / "k.parquet"),
                        "--distributed-by", "k", *at))  # fmt: skip
    assert "loaded 50 rows into remote_k" in loaded
    assert "inserted 50 rows" in ok(as_user("bob", "insert", "remote_k",
                                            str(tmp_path / "k.parquet"), *at))  # fmt: skip
    one_line_error(as_user("alice", "sql", "SELECT count(*) FROM remote_k", *at),
                   "PermissionDeniedError", "remote_k")  # fmt: skip
    ok(as_user("bob", "sql", "GRANT SELECT ON remote_k TO alice", *at))  # bob's table: his grant
    granted = ok(as_user("alice", "sql", "SELECT count(*) AS n FROM remote_k", "--format",
                         "json", *at))  # fmt: skip
    assert json.loads(granted) == {"n": 100}
    nodes = [json.loads(line) for line in ok(as_user(
        "olga", "cluster", "nodes", "--format", "json", *at)).splitlines()]  # fmt: skip
    assert nodes and all(n["alive"] for n in nodes)
    shards = [json.loads(line) for line in ok(as_user(
        "olga", "cluster", "shards", "--format", "json", *at)).splitlines()]  # fmt: skip
    assert {s["table"] for s in shards} >= {"t", "remote_k"}
    assert "dropped remote_k" in ok(as_user("bob", "drop", "remote_k", *at))
    one_line_error(as_user("alice", "drop", "t", *at), "PermissionDeniedError")

    token = ok(shardflow_cli("token", "create", "--role", "reader",
                             "--data-dir", str(served.data_dir))).splitlines()[-1]  # fmt: skip
    with_token = subprocess.run(
        [SHARDFLOW, "sql", "SELECT 1 AS one", "--format", "csv", *at],
        capture_output=True, text=True, timeout=300, env={**os.environ, "SHARDFLOW_TOKEN": token},
    )  # fmt: skip
    assert ok(with_token).split() == ['"one"', "1"]


def test_the_way_to_a_service_is_said(served: Served) -> None:
    here = ("--data-dir", str(served.data_dir))
    one_line_error(shardflow_cli("sql", "SELECT 1", *here), "DataDirInUseError",
                   f"--address {served.uri}", "--user")  # fmt: skip
    one_line_error(shardflow_cli("tables", "--address", served.uri), "--user NAME", "--token")
    wrong = subprocess.run(
        [SHARDFLOW, "tables", "--address", served.uri, "--user", "alice"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "SHARDFLOW_PASSWORD": "not-hers"},
    )  # fmt: skip
    one_line_error(wrong, "AuthenticationError")
