"""The predictive balancer against the reactive one on ``bench/balancer_sim.py``'s daily
trace, small and seeded (deterministic): after the day it learns from, nodes spend at most
half the time over the threshold, and fewer bytes move. A regression test of the policy;
the bench plays the bigger trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from shardflow.control.balancer import BalancerSettings

BENCH = Path(__file__).resolve().parents[2] / "bench" / "balancer_sim.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("balancer_sim", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("balancer_sim", module)
    spec.loader.exec_module(module)
    return module


def test_deciding_ahead_halves_the_overload_after_a_day_and_moves_fewer_bytes() -> None:
    sim = bench()
    settings = BalancerSettings(max_moves=4, max_unit_bytes=1 << 50, min_unit_bytes=1)
    over = {"reactive": 0.0, "predictive": 0.0}
    moved = {"reactive": 0, "predictive": 0}
    for seed in (1, 2, 3):
        nodes, units, load, placement = sim.diurnal_trace(6, 72, 3, seed)
        for name in over:
            daily, nbytes, _ = sim.play(
                name == "predictive", nodes, units, load, placement, 3, 600.0, 120.0, settings
            )
            over[name] += sum(daily[1:])  # the first day is learnt from
            moved[name] += nbytes
    assert over["reactive"] > 0  # the trace does overload a reactive balancer
    assert over["predictive"] <= 0.5 * over["reactive"], over
    assert moved["predictive"] < moved["reactive"], moved
