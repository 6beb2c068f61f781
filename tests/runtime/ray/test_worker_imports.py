"""What a worker process imports: the module holding the actor classes, which every Ray
worker process of a cluster loads at start. On two cores five such processes start at
once, so what they import is start-up time (``bench/startup.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

PLANNING = {"sqlglot", "shardflow.sql.planner", "shardflow.sql.explain", "polars"}
"""Used to make plans (the client) or by the Polars engine (GPU nodes), never by a CPU
worker or the coordinator."""


def loaded_after(statement: str) -> set[str]:
    script = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


CONTROL_PLANE = {
    "shardflow.runtime.coordinator.node",
    "shardflow.runtime.coordinator.controller",
    "shardflow.runtime.coordinator.state",
    "shardflow.runtime.ray.membership",
    "shardflow.telemetry.console",
    "prometheus_client",
}
"""Run by the coordinator alone (~0.1 s of CPU to import, in each of four workers)."""


def test_the_actor_module_does_not_import_the_planner_or_the_control_plane() -> None:
    loaded = loaded_after("import shardflow.runtime.ray.actors")
    assert {"shardflow.runtime.worker.node", "shardflow.sql.plan", "duckdb"} <= loaded  # it ran
    assert not PLANNING & loaded
    assert not CONTROL_PLANE & loaded


def test_the_planner_is_still_there_for_those_who_ask() -> None:
    loaded = loaded_after(
        "from shardflow.sql import plan, explain, Stage\n"
        "assert callable(plan) and callable(explain) and Stage.__name__ == 'Stage'"
    )
    assert "shardflow.sql.planner" in loaded
