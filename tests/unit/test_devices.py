"""Device discovery and engine choice, on plain data: which engine each kind of device
gets, and what a node without telemetry reports."""

from __future__ import annotations

from shardflow.telemetry.devices import (
    CPU_ENGINE,
    GPU_ENGINE,
    DeviceInfo,
    DeviceState,
    choose_engine,
    cuda_index,
    device_state,
    discover,
)

ALL = {"polars": True, "cudf_polars": True}


def test_engine_per_device() -> None:
    h200 = DeviceInfo("nvidia", "NVIDIA H200", 141 << 30, 0)
    mi300 = DeviceInfo("amd", "AMD Instinct MI300X", 192 << 30, 0)
    cpu = DeviceInfo("cpu", "Xeon", 64 << 30)
    assert choose_engine(h200, ALL) == (GPU_ENGINE, "")
    engine, note = choose_engine(h200, {"polars": True, "cudf_polars": False})
    assert engine == CPU_ENGINE and "shardflow[gpu]" in note
    engine, note = choose_engine(mi300, ALL)  # documented: AMD runs the CPU engine
    assert engine == CPU_ENGINE and "ROCm" in note
    assert choose_engine(cpu, ALL) == (CPU_ENGINE, "")


def test_cuda_numbers_follow_the_visible_devices() -> None:
    assert cuda_index(3, visible="3") == 0  # Ray pinned GPU 3: CUDA calls it 0
    assert cuda_index(5, visible="4,5") == 1
    assert cuda_index(2, visible="") == 2


def test_a_cpu_only_install_finds_the_cpu_without_error() -> None:
    device = discover()
    assert device.vendor in {"cpu", "nvidia", "amd"}
    assert device.memory_bytes > 0 and device.model


def test_device_telemetry_is_none_where_there_is_none() -> None:
    cpu = DeviceInfo("cpu", "Xeon", 64 << 30)
    assert device_state(cpu) == DeviceState(None, None, None)
    # a GPU whose driver (or nvidia-ml-py) is not there reports nothing, and does not fail
    if discover().vendor == "cpu":
        gone = DeviceInfo("nvidia", "NVIDIA H200", 141 << 30, 7)
        assert device_state(gone) == DeviceState()
