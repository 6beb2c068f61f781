"""A worker's calibration is measured once per kind of node and data directory: workers of
the same kind that start later reuse it (start-up takes seconds less), a different kind or
``fresh=True`` measures again."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardflow.config import Settings
from shardflow.runtime.worker import node as worker
from shardflow.runtime.worker.node import WorkerNode


def test_a_calibration_is_measured_once_per_kind_of_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[str] = []
    real = worker.calibrate

    def counting(run: object) -> dict[str, float]:
        measured.append("x")
        return real(run)  # type: ignore[arg-type]

    monkeypatch.setattr(worker, "calibrate", counting)
    settings = Settings(engine_threads=1)
    first = WorkerNode("node-0", str(tmp_path), settings).calibrate()
    assert len(measured) == 1
    second = WorkerNode("node-1", str(tmp_path), settings).calibrate()
    assert len(measured) == 1  # reused
    assert second.calibration == first.calibration and second.capacity == first.capacity
    slower = WorkerNode("node-2", str(tmp_path), settings, slowdown=2.0).calibrate()
    assert len(measured) == 2 and slower.simulated  # another kind of node
    WorkerNode("node-3", str(tmp_path), settings).calibrate(fresh=True)
    assert len(measured) == 3  # measured again on request
    for path in (tmp_path / "calibration").iterdir():
        path.write_text("{torn")  # an unreadable file is measured again, not trusted
    WorkerNode("node-4", str(tmp_path), settings).calibrate()
    assert len(measured) == 4
