"""The data directory's format (``catalog/version.py``) on real files: recorded when its
owner first opens it, a format newer than this release reads is refused before anything is
read (the lease given back), and an older one is migrated forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardflow.catalog import DataDir, version
from shardflow.config import Settings
from shardflow.errors import StorageError
from shardflow.runtime.coordinator.state import CoordinatorState


def record(root: Path) -> dict[str, object]:
    return json.loads((root / version.FORMAT_FILE).read_text())


def test_a_new_data_directory_records_its_format_and_keeps_its_catalog(tmp_path: Path) -> None:
    state = CoordinatorState(str(tmp_path), Settings())
    assert record(tmp_path) == {"format": version.FORMAT, "written_by": version.release()}
    state.release_lease()
    (tmp_path / version.FORMAT_FILE).unlink()  # as written before formats were recorded
    again = CoordinatorState(str(tmp_path), Settings())
    assert record(tmp_path)["format"] == version.FORMAT  # format 1, now said so
    again.release_lease()


def test_a_newer_format_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    CoordinatorState(str(tmp_path), Settings()).release_lease()
    newer = {"format": version.FORMAT + 1, "written_by": "9.0.0"}
    (tmp_path / version.FORMAT_FILE).write_text(json.dumps(newer))
    with pytest.raises(StorageError, match=r"format 2, written by shardflow 9\.0\.0.*1 to 1"):
        CoordinatorState(str(tmp_path), Settings())
    (tmp_path / version.FORMAT_FILE).write_text("{not json")
    with pytest.raises(StorageError, match="unreadable FORMAT"):
        CoordinatorState(str(tmp_path), Settings())
    # the refused openers gave the lease back: a release that reads it takes it at once
    (tmp_path / version.FORMAT_FILE).write_text(json.dumps({"format": 1}))
    CoordinatorState(str(tmp_path), Settings()).release_lease()


def test_an_older_format_is_migrated_forward_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[int] = []
    monkeypatch.setattr(version, "FORMAT", 3)
    monkeypatch.setattr(
        version, "MIGRATIONS", {1: lambda d: steps.append(1), 2: lambda d: steps.append(2)}
    )
    data_dir = DataDir.resolve(str(tmp_path))
    assert version.open_format(data_dir) == 1  # none recorded: format 1
    assert steps == [1, 2] and record(tmp_path)["format"] == 3
    assert version.open_format(data_dir) == 3 and steps == [1, 2]


def test_a_worker_of_an_older_release_does_not_serve_a_newer_format(tmp_path: Path) -> None:
    from shardflow.runtime.worker.node import WorkerNode

    newer = {"format": version.FORMAT + 1, "written_by": "9.0.0"}
    (tmp_path / version.FORMAT_FILE).write_text(json.dumps(newer))
    with pytest.raises(StorageError, match="run the newer release"):
        WorkerNode("node-0", str(tmp_path), Settings())
