"""A worker's local folder (DuckDB spills there): its own per process, and the folders of
worker processes that are gone (a SIGKILL leaves them behind) removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardflow.engine.duckdb_engine import DuckDBEngine
from shardflow.runtime.worker.local import default_memory_mb, local_folder


def test_folders_of_gone_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f"node-1-{int(gone.stdout)}"
    (stale / "spill").mkdir(parents=True)
    alive = tmp_path / f"node-2-{os.getppid()}"  # a process that runs (pytest's parent)
    alive.mkdir()
    mine = local_folder(str(tmp_path), "node-3")
    assert mine == str(tmp_path / f"node-3-{os.getpid()}")
    assert not stale.exists() and alive.exists()


def test_an_engine_spills_to_its_folder_beyond_its_memory_limit(tmp_path: Path) -> None:
    folder = local_folder(str(tmp_path), "node-1")
    engine = DuckDBEngine(threads=1, memory_limit="32MiB", temp_directory=folder)
    try:
        engine.execute("CREATE TABLE t AS SELECT range AS k, md5(range::VARCHAR) AS s "
                       "FROM range(1500000)")  # fmt: skip
        held, spilled = engine.memory()
        assert held <= 32 << 20 and spilled > 16 << 20, (held, spilled)
        assert any(Path(folder).iterdir())
        answer = engine.run("SELECT count(DISTINCT s) AS n FROM t").to_pylist()
        assert answer == [{"n": 1_500_000}]
        external = "SELECT * FROM read_csv('/etc/hostname')"
        try:  # the folder is set, and files are still closed to SQL
            engine.run(external)
            raise AssertionError("SQL read a file")
        except Exception as error:
            assert "disabled by configuration" in str(error)
    finally:
        engine.close()


def test_the_default_share_divides_the_machine_among_its_workers() -> None:
    one, four = default_memory_mb(1), default_memory_mb(4)
    assert one > 0 and abs(four - one // 4) <= 1
    assert default_memory_mb(10**9) == 16  # never below what DuckDB needs
