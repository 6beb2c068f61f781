"""What a worker is and runs on: the engine its device gets, the profile it reports, and
the calibration kept per kind of node in the data directory (a worker of a known kind starts
calibrated and measures nothing)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping

import pyarrow as pa

from shardflow.catalog import DataDir
from shardflow.config import Settings
from shardflow.engine import DuckDBEngine, Engine
from shardflow.engine.simulated import SlowedEngine
from shardflow.runtime.worker.resident import KeepsFrames, ResidentShards
from shardflow.telemetry.calibration import OPERATORS, capacity
from shardflow.telemetry.devices import (
    GPU_ENGINE,
    DeviceInfo,
    NodeProfile,
    choose_engine,
    cuda_index,
    installed,
)

log = logging.getLogger(__name__)

CALIBRATION_FOLDER = "calibration"
"""Where measured calibrations are kept in the data directory, one file per kind of node."""
CALIBRATION_VERSION = 1
"""Bumped when what calibration measures changes: older files are not reused."""


def make_executor(
    engine: DuckDBEngine, device: DeviceInfo, slowdown: float, choice: str = "auto"
) -> Engine:
    """The engine that runs this node's fragments: ``choice`` ("auto" follows the device,
    see ``choose_engine``), slowed down for a simulated device."""
    has = {"polars": installed("polars"), "cudf_polars": installed("cudf_polars")}
    picked, _ = choose_engine(device, has)
    executor: Engine = engine
    if choice == "polars" or (choice == "auto" and picked == GPU_ENGINE):
        from shardflow.engine.polars_engine import PolarsEngine  # SQLGlot: only where used

        gpu = device.vendor == "nvidia" and has["cudf_polars"]
        executor = PolarsEngine(engine, gpu=gpu, device=cuda_index(device.index or 0))
    if slowdown > 1:
        return SlowedEngine(executor, slowdown)
    return executor


DEVICE_CACHE_SHARE = 0.5
"""Of the device's memory (on a CPU: of the worker's memory limit), what the kept shard
frames may take by default (``device_cache_mb`` = 0); the rest is the queries'."""


def resident_shards(
    executor: Engine, device: DeviceInfo, settings: Settings, memory_limit_mb: int
) -> ResidentShards | None:
    """The shard frames a worker keeps in its engine's memory, where its engine is Polars
    (on the device for the GPU engine); None where fragments read their shards out of
    DuckDB every time (DuckDB's own engine, a simulated slower device, or
    ``device_cache_mb`` = -1)."""
    if not isinstance(executor, KeepsFrames) or settings.device_cache_mb < 0:
        return None
    if settings.device_cache_mb:
        budget = settings.device_cache_mb << 20
    elif device.vendor != "cpu" and device.memory_bytes:
        budget = int(device.memory_bytes * DEVICE_CACHE_SHARE)
    else:
        budget = int((memory_limit_mb << 20) * DEVICE_CACHE_SHARE)
    return ResidentShards(executor.frames, budget, settings.test_fault_resident)


def node_profile(
    node_id: str,
    device: DeviceInfo,
    executor: Engine,
    throughput: Mapping[str, float],
    slowdown: float,
) -> NodeProfile:
    _, note = choose_engine(
        device, {"polars": installed("polars"), "cudf_polars": installed("cudf_polars")}
    )
    model = device.model if slowdown <= 1 else f"simulated x{slowdown:g} slower {device.model}"
    return NodeProfile(
        node_id=node_id,
        vendor=device.vendor,
        model=model,
        memory_bytes=device.memory_bytes,
        cores=os.cpu_count() or 1,
        engine=executor.name,
        capacity=round(capacity(throughput), 3) if throughput else 1.0,
        simulated=slowdown > 1,
        engine_note=note,
        calibration=dict(throughput),
    )


def calibration_path(
    data_dir: DataDir, device: DeviceInfo, executor: Engine, threads: int | None, slowdown: float
) -> str:
    """Where the calibration of this kind of node is kept: one file per device, engine,
    engine threads and simulated slowdown."""
    parts = (
        f"v{CALIBRATION_VERSION}",
        device.vendor,
        device.model,
        executor.name,
        f"t{threads}",
        f"x{slowdown:g}",
    )
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts))
    return data_dir.path(CALIBRATION_FOLDER, f"{key}.json")


def kept_calibration(data_dir: DataDir, path: str) -> dict[str, float] | None:
    """The throughput per operator kept at ``path``; None where there is none, or one of
    another version's operators (measured again)."""
    try:
        cached = json.loads(data_dir.read(path))
    except (OSError, ValueError, pa.ArrowException):
        return None
    if not isinstance(cached, dict) or set(cached) != set(OPERATORS):
        return None
    return {str(k): float(v) for k, v in cached.items()}


def keep_calibration(data_dir: DataDir, path: str, throughput: Mapping[str, float]) -> None:
    """Keep a measured calibration for the nodes of its kind that start later (a cache:
    where it cannot be written, the next node measures again)."""
    try:
        data_dir.write_atomic(path, json.dumps(dict(throughput)).encode(), sync=False)
    except (OSError, pa.ArrowException) as error:
        log.info("calibration not kept: %s", error)
