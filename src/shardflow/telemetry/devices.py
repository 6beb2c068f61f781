"""What a node runs on: the device a worker finds (NVIDIA through NVML, AMD through AMD SMI,
else the CPU), which engine that device gets, and the profile the worker reports.

The GPU libraries are optional (``pip install shardflow[gpu]``) and imported only inside the
probes, so a CPU-only install imports cleanly and finds no GPU without error.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CPU_ENGINE = "duckdb"
GPU_ENGINE = "polars-gpu"


@dataclass(frozen=True)
class DeviceInfo:
    vendor: str
    """"nvidia", "amd" or "cpu"."""
    model: str
    memory_bytes: int
    index: int | None = None
    """The GPU's index on its machine (None for a CPU)."""


@dataclass(frozen=True)
class NodeProfile:
    """A worker's device, engine and measured capacity (1.0 = the reference CPU node)."""

    node_id: str
    vendor: str
    model: str
    memory_bytes: int
    cores: int
    engine: str
    capacity: float = 1.0
    simulated: bool = False
    """A simulated device: a CPU worker slowed down on purpose (tests and demos)."""
    engine_note: str = ""
    """Why the engine is what it is (e.g. a GPU without its dataframe engine installed)."""
    calibration: Mapping[str, float] = field(default_factory=dict)
    """Rows per second per operator, from the worker's start-up micro-benchmark."""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia(index: int | None) -> DeviceInfo | None:
    try:
        import pynvml  # type: ignore[import-not-found]  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index or 0)
        model = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    except Exception:  # no driver, no device: a CPU node after all
        return None
    model = model.decode() if isinstance(model, bytes) else str(model)
    return DeviceInfo("nvidia", model, int(memory), index or 0)


def _amd(index: int | None) -> DeviceInfo | None:
    try:
        import amdsmi  # type: ignore[import-not-found]  # optional: AMD SMI
    except ImportError:
        return None
    try:
        amdsmi.amdsmi_init()
        handles = amdsmi.amdsmi_get_processor_handles()
        if not handles:
            return None
        handle = handles[index or 0]
        model = amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name", "AMD GPU")
        memory = amdsmi.amdsmi_get_gpu_memory_total(handle, amdsmi.AmdSmiMemoryType.VRAM)
    except Exception:  # no driver, no device: a CPU node after all
        return None
    return DeviceInfo("amd", str(model), int(memory), index or 0)


def discover(gpu_index: int | None = None) -> DeviceInfo:
    """The device of this process: the GPU Ray gave it, if any, else the CPU."""
    if gpu_index is not None or os.environ.get("CUDA_VISIBLE_DEVICES"):
        for probe in (_nvidia, _amd):
            found = probe(gpu_index)
            if found is not None:
                return found
    return DeviceInfo("cpu", _cpu_model(), machine_memory_bytes())


@dataclass(frozen=True)
class DeviceState:
    """A GPU's utilisation (0..1) and memory now; None where telemetry has nothing (a CPU,
    or a driver that does not answer)."""

    utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    errors: int | None = None
    """Uncorrectable ECC errors since the driver loaded (NVML's volatile count, AMD SMI's
    total); a rising count makes the node's failure rate rise."""


@dataclass(frozen=True)
class MemoryState:
    """Memory the worker's process uses (resident) and the machine has free, in bytes; on
    a worker also what its DuckDB holds, has spilled to local disk, and may hold."""

    used_bytes: int = 0
    free_bytes: int = 0
    engine_bytes: int = 0
    spilled_bytes: int = 0
    limit_bytes: int = 0


def device_state(device: DeviceInfo) -> DeviceState:
    """The GPU's utilisation and memory used and free now, where telemetry has them."""
    try:
        if device.vendor == "nvidia":
            import pynvml

            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return DeviceState(
                utilization=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
                memory_used_bytes=int(memory.used),
                memory_free_bytes=int(memory.free),
                errors=_nvidia_errors(pynvml, handle),
            )
        if device.vendor == "amd":
            import amdsmi

            handle = amdsmi.amdsmi_get_processor_handles()[device.index or 0]
            vram = amdsmi.AmdSmiMemoryType.VRAM
            used = int(amdsmi.amdsmi_get_gpu_memory_usage(handle, vram))
            return DeviceState(
                utilization=amdsmi.amdsmi_get_gpu_activity(handle)["gfx_activity"] / 100.0,
                memory_used_bytes=used,
                memory_free_bytes=device.memory_bytes - used,
                errors=_amd_errors(amdsmi, handle),
            )
    except Exception:  # telemetry must never break a worker
        pass
    return DeviceState()


def _nvidia_errors(pynvml: Any, handle: Any) -> int | None:
    try:  # GPUs without ECC (most consumer ones) have no count
        return int(
            pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
    except Exception:
        return None


def _amd_errors(amdsmi: Any, handle: Any) -> int | None:
    try:
        return int(amdsmi.amdsmi_get_gpu_total_ecc_count(handle)["uncorrectable_count"])
    except Exception:
        return None


def cuda_index(physical: int, visible: str | None = None) -> int:
    """The CUDA device number of a GPU that NVML numbers ``physical``: Ray pins a GPU actor
    with ``CUDA_VISIBLE_DEVICES``, which renumbers the visible GPUs from 0 (NVML does not)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    return ids.index(str(physical)) if str(physical) in ids else physical


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def choose_engine(device: DeviceInfo, has: Mapping[str, bool]) -> tuple[str, str]:
    """The engine for a device, and a note on why. NVIDIA GPUs run Polars with the
    cudf-polars GPU engine when it is installed; AMD GPUs run the CPU engine, as no ROCm
    dataframe engine is supported yet; everything else runs DuckDB."""
    if device.vendor == "nvidia":
        if has.get("cudf_polars") and has.get("polars"):
            return GPU_ENGINE, ""
        return CPU_ENGINE, "cudf-polars is not installed (pip install shardflow[gpu])"
    if device.vendor == "amd":
        return CPU_ENGINE, "no ROCm dataframe engine is supported: the CPU engine runs"
    return CPU_ENGINE, ""


def device_model(profile: NodeProfile) -> str:
    """What counts as one device model in a reported profile: nodes of one model share
    their calibration (a node measured while the machine was busy is not slower)."""
    return f"{profile.vendor}/{profile.model}/{profile.engine}"


def memory_state() -> MemoryState:
    """Memory the worker's process uses and the machine has free, in bytes."""
    used = free = 0
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    used = int(line.split()[1]) * 1024
        with open("/proc/meminfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    return MemoryState(used, free)
