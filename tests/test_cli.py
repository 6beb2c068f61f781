"""The ``shardflow`` command, run as users run it (a real process each time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHARDFLOW, *args], capture_output=True, text=True, timeout=600)


def test_demo_then_sql_on_its_data_directory(tmp_path: Path) -> None:
    demo = run("demo", "--sf", "0.01", "--workers", "2", "--repeat", "1", "--home", str(tmp_path))
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "answers equal: 22/22" in demo.stdout
    assert "Q22" in demo.stdout and "geometric mean ratio" in demo.stdout
    assert "node-1" in demo.stdout and "duckdb" in demo.stdout  # the workers and engines

    data_dir = str(tmp_path / "db-sf0.01")
    sql = run("sql", "SELECT count(*) AS n FROM orders", "--data-dir", data_dir, "--workers", "1")
    assert sql.returncode == 0, sql.stderr[-3000:]
    assert "15000" in sql.stdout

    explain = run(
        "explain", "SELECT o_orderstatus, count(*) FROM orders GROUP BY 1", "--data-dir", data_dir
    )
    assert explain.returncode == 0 and "partial aggregate" in explain.stdout

    bad = run("sql", "SELECT * FROM nope", "--data-dir", data_dir, "--workers", "1")
    assert bad.returncode == 2
    assert "UnknownTableError" in bad.stdout


def test_help_lists_commands() -> None:
    shown = run("--help")
    assert shown.returncode == 0
    for command in ("demo", "sql", "explain", "tables"):
        assert command in shown.stdout
