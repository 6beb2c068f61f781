"""TPC-H support: the 22 queries, Parquet data generation via tpchgen-cli, and a DuckDB oracle."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import duckdb

__all__ = [
    "LAYOUT",
    "QUERY_NUMBERS",
    "TABLES",
    "TableLayout",
    "duckdb_oracle",
    "generate",
    "load",
    "queries",
    "query",
    "table_paths",
]

TABLES: tuple[str, ...] = (
    "part",
    "supplier",
    "partsupp",
    "customer",
    "orders",
    "lineitem",
    "nation",
    "region",
)
"""The eight TPC-H tables, in the order the spec lists them."""

QUERY_NUMBERS: tuple[int, ...] = tuple(range(1, 23))
"""Valid arguments to :func:`query`."""


@dataclass(frozen=True, slots=True)
class TableLayout:
    """How one TPC-H table is placed on a shardflow cluster."""

    name: str
    distributed_by: str | None
    colocate_with: str | None
    replicated: bool

    def __post_init__(self) -> None:
        if self.replicated and (self.distributed_by or self.colocate_with):
            raise ValueError(f"{self.name}: a replicated table has no distribution key")
        if not self.replicated and not self.distributed_by:
            raise ValueError(f"{self.name}: a distributed table needs distributed_by")


LAYOUT: tuple[TableLayout, ...] = (
    TableLayout("lineitem", distributed_by="l_orderkey", colocate_with=None, replicated=False),
    TableLayout("orders", distributed_by="o_orderkey", colocate_with="lineitem", replicated=False),
    TableLayout("customer", distributed_by=None, colocate_with=None, replicated=True),
    TableLayout("part", distributed_by=None, colocate_with=None, replicated=True),
    TableLayout("partsupp", distributed_by=None, colocate_with=None, replicated=True),
    TableLayout("supplier", distributed_by=None, colocate_with=None, replicated=True),
    TableLayout("nation", distributed_by=None, colocate_with=None, replicated=True),
    TableLayout("region", distributed_by=None, colocate_with=None, replicated=True),
)
"""Recommended layout, in load order: lineitem and orders co-located on the order key."""


# --------------------------------------------------------------------------- queries


def query(n: int) -> str:
    """Return the SQL text of TPC-H query ``n`` (1..22), without a trailing semicolon."""
    if isinstance(n, bool) or not isinstance(n, int) or n not in QUERY_NUMBERS:
        raise ValueError(f"TPC-H query number must be an int in 1..22, got {n!r}")
    resource = resources.files(__name__).joinpath("queries", f"q{n:02d}.sql")
    text = resource.read_text(encoding="utf-8").strip()
    return text.removesuffix(";").rstrip()


def queries() -> dict[int, str]:
    """Return all 22 TPC-H queries keyed by query number."""
    return {n: query(n) for n in QUERY_NUMBERS}


# --------------------------------------------------------------------------- data


def table_paths(data_dir: os.PathLike[str] | str) -> dict[str, Path]:
    """Map each table name to ``<data_dir>/<table>.parquet`` (the files need not exist)."""
    root = Path(data_dir)
    return {name: root / f"{name}.parquet" for name in TABLES}


def _is_complete(data_dir: Path) -> bool:
    return data_dir.is_dir() and all(p.is_file() for p in table_paths(data_dir).values())


def _tpchgen_executable() -> str:
    exe_name = "tpchgen-cli.exe" if os.name == "nt" else "tpchgen-cli"
    # Do not resolve symlinks: a venv's python links out of the venv's bin dir.
    candidate = Path(sys.executable).parent / exe_name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("tpchgen-cli")
    if found is not None:
        return found
    raise RuntimeError(
        "tpchgen-cli not found next to the Python interpreter or on PATH; "
        "install it with `pip install tpchgen-cli` to generate TPC-H data"
    )


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def generate(sf: float, out_dir: os.PathLike[str] | str, *, overwrite: bool = False) -> Path:
    """Write the 8 TPC-H tables at scale factor ``sf`` as Parquet under ``out_dir/sf<sf>``.

    Data is generated into a temporary sibling folder that is renamed into place only once
    complete. An already complete folder is reused unless ``overwrite`` is true.
    Returns the folder holding ``<table>.parquet`` for every table.
    """
    if isinstance(sf, bool) or not isinstance(sf, int | float):
        raise TypeError(f"scale factor must be a number, got {sf!r}")
    sf = float(sf)
    if not 0 < sf < float("inf"):
        raise ValueError(f"scale factor must be a positive finite number, got {sf!r}")

    root = Path(out_dir)
    target = root / f"sf{sf:g}"
    if not overwrite and _is_complete(target):
        return target

    exe = _tpchgen_executable()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        cmd = [
            exe,
            "parquet",
            "--scale-factor",
            repr(sf),
            "--output-dir",
            str(staging),
            "--quiet",
            "--no-progress",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip()
            raise RuntimeError(
                f"tpchgen-cli failed with exit code {proc.returncode}: {' '.join(cmd)}\n{detail}"
            )
        missing = [p.name for p in table_paths(staging).values() if not p.is_file()]
        if missing:
            raise RuntimeError(f"tpchgen-cli did not write {', '.join(missing)} in {staging}")
        _install(staging, target, overwrite=overwrite)
    finally:
        if staging.exists():
            _remove_tree(staging)
    return target


def _install(staging: Path, target: Path, *, overwrite: bool) -> None:
    """Rename the finished ``staging`` folder to ``target``, replacing an old one if needed."""
    if target.exists():
        if not overwrite and _is_complete(target):
            return  # a concurrent generate() finished first; keep its data
        # Move the old (incomplete, or to-be-overwritten) folder aside, then swap in.
        trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
        target.rename(trash)
        try:
            staging.rename(target)
        except OSError:
            if not target.exists():
                with contextlib.suppress(OSError):
                    trash.rename(target)
            raise
        _remove_tree(trash)
        return
    try:
        staging.rename(target)
    except OSError:
        # Lost a race with a concurrent generate(): accept its result if it is complete.
        if not _is_complete(target):
            raise


# --------------------------------------------------------------------------- oracle


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class _Creates(Protocol):
    def create_table(
        self,
        name: str,
        source: object,
        *,
        distributed_by: str | None = ...,
        replicated: bool = ...,
        colocate_with: str | None = ...,
        key_index: bool = ...,
        progress: bool = ...,
    ) -> int: ...


def load(
    db: _Creates,
    data_dir: os.PathLike[str] | str,
    *,
    progress: bool = False,
    key_index: Collection[str] = (),
    tables: Collection[str] | None = None,
) -> None:
    """Create the 8 tables (or those named in ``tables``) in a shardflow database with the
    recommended :data:`LAYOUT`; the distributed tables named in ``key_index`` index their
    key in every shard."""
    paths = table_paths(data_dir)
    for layout in LAYOUT:
        if tables is not None and layout.name not in tables:
            continue
        db.create_table(
            layout.name,
            paths[layout.name],
            distributed_by=layout.distributed_by,
            colocate_with=layout.colocate_with,
            replicated=layout.replicated,
            key_index=layout.name in key_index,
            progress=progress,
        )


def duckdb_oracle(
    data_dir: os.PathLike[str] | str, memory_limit_mb: int = 0
) -> duckdb.DuckDBPyConnection:
    """Open an in-memory DuckDB connection with the 8 tables loaded from ``data_dir``
    (``memory_limit_mb``: DuckDB's memory limit; it spills to ``tmp`` beside the data)."""
    paths = table_paths(data_dir)
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"TPC-H Parquet files missing: {', '.join(missing)}")
    config = {}
    if memory_limit_mb:
        config = {"memory_limit": f"{memory_limit_mb}MiB", "temp_directory": f"{data_dir}/tmp"}
    con = duckdb.connect(":memory:", config=config)
    try:
        for name, path in paths.items():
            con.execute(
                f"CREATE TABLE {name} AS SELECT * FROM read_parquet({_sql_string(str(path))})"
            )
    except BaseException:
        con.close()
        raise
    return con
