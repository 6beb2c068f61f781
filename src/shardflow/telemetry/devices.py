"""What a node runs on: a device profile probed when a worker starts."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeProfile:
    """A worker's device. ``capacity`` weighs placement (1.0 = a reference CPU node)."""

    node_id: str
    vendor: str
    model: str
    memory_bytes: int
    cores: int
    engine: str
    capacity: float = 1.0
    simulated: bool = False


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def probe(node_id: str) -> NodeProfile:
    """This process's device (CPU here; GPU probes plug in with the GPU engine)."""
    return NodeProfile(
        node_id=node_id,
        vendor="cpu",
        model=_cpu_model(),
        memory_bytes=_memory_bytes(),
        cores=os.cpu_count() or 1,
        engine="duckdb",
    )
