"""The coordinator's active side: it watches the workers (failover), runs live moves, drains
nodes and, every poll interval, asks the balancer what to do. Decisions come from the pure
policies in ``control/``; this module only turns them into worker calls."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from shardflow.config import Settings
from shardflow.control.migration import MigrationPolicy, MigrationState, MovePlan
from shardflow.errors import MoveRefusedError, UnknownShardError
from shardflow.runtime.coordinator import CoordinatorState
from shardflow.runtime.migrator import Migrator

log = logging.getLogger(__name__)
NAMESPACE = "shardflow"


@dataclass(frozen=True)
class Failover:
    node: str
    detected_at: float
    units: int
    seconds: float
    """From detection until every new owner served the reassigned shards."""


class Controller:
    def __init__(self, state: CoordinatorState, prefix: str, settings: Settings) -> None:
        self.state = state
        self.prefix = prefix
        self.settings = settings
        self._handles: dict[str, Any] = {}
        self.migrator = Migrator(
            state,
            self.worker,
            MigrationPolicy(),
            bandwidth_bytes_s=settings.migration_bandwidth_mb_s * 1e6,
        )
        self.failovers: list[Failover] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # -- workers ------------------------------------------------------------------------
    def worker(self, node: str) -> Any:
        handle = self._handles.get(node)
        if handle is None:
            try:
                handle = ray.get_actor(f"{self.prefix}-worker-{node}", namespace=NAMESPACE)
            except ValueError:
                raise UnknownShardError(f"node {node} has no running worker") from None
            self._handles[node] = handle
        return handle

    def broadcast(self, catalog: dict[str, Any], wait: bool = True) -> None:
        """Tell every live worker about a catalog change (they load what is now theirs)."""
        calls = []
        for node in self.state.catalog.nodes:
            try:
                calls.append(self.worker(node).sync.remote(catalog))
            except UnknownShardError:
                continue
        if wait:
            for call in calls:
                try:
                    ray.get(call, timeout=self.settings.retry_deadline_s)
                except (RayActorError, GetTimeoutError) as error:
                    log.info("a worker did not take the catalog: %s", error)

    # -- failover -----------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._resume, name="resume", daemon=True).start()
        threading.Thread(target=self._watch, name="monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _resume(self) -> None:
        try:
            for state in self.migrator.resume_unfinished():
                log.info("resumed move %s: %s", state.plan.move_id, state.outcome)
        except Exception:  # a resume must never take the coordinator down
            log.exception("resuming unfinished moves failed")

    def _watch(self) -> None:
        misses: Counter[str] = Counter()
        while not self._stop.wait(self.settings.health_interval_s):
            watched = [n for n in self.state.catalog.nodes if n in self.state.profiles]
            pings = {}
            for node in watched:
                try:
                    pings[node] = self.worker(node).ping.remote()
                except UnknownShardError:
                    misses[node] = self.settings.health_misses
            for node, call in pings.items():
                try:
                    ray.get(call, timeout=self.settings.health_interval_s)
                    misses[node] = 0
                except GetTimeoutError:
                    misses[node] += 1
                except RayActorError:
                    misses[node] = self.settings.health_misses  # died: no doubt about it
            for node in watched:
                if misses[node] >= self.settings.health_misses:
                    misses.pop(node)
                    self.fail_node(node)

    def fail_node(self, node: str) -> Failover | None:
        """A worker is gone: its units go to healthy nodes, which rebuild them from storage."""
        detected = time.time()
        units = len(
            [u for g in self.state.catalog.groups.values() for u in g.units if u.node == node]
        )
        catalog = self.state.node_left(node)
        if catalog is None:
            return None
        log.warning("node %s is gone; %d unit(s) reassigned", node, units)
        self._handles.pop(node, None)
        self.state.profiles.pop(node, None)
        self.broadcast(catalog)
        record = Failover(node, detected, units, time.time() - detected)
        self.failovers.append(record)
        return record

    # -- moves --------------------------------------------------------------------------
    def run_move(self, plan: MovePlan) -> dict[str, Any]:
        state = self.migrator.run(plan)
        return record(state, self.state.catalog.group_tables(plan.group))

    def history(self) -> list[dict[str, Any]]:
        catalog = self.state.catalog
        return [
            record(state, catalog.group_tables(state.plan.group)) for state in self.migrator.history
        ]

    def drain(self, node: str, deadline_s: float) -> dict[str, Any]:
        """Move every unit off ``node`` live; then it leaves. Past the deadline, stop and
        leave the node serving what it still holds."""
        if node not in self.state.catalog.nodes:
            raise UnknownShardError(f"{node!r} is not a node of the cluster")
        others = [n for n in self.state.catalog.nodes if n != node]
        if not others:
            raise MoveRefusedError(f"{node} is the last node; nothing could take its shards")
        deadline = time.monotonic() + deadline_s
        moved: list[dict[str, Any]] = []
        while True:
            units = [
                u for g in self.state.catalog.groups.values() for u in g.units if u.node == node
            ]
            if not units:
                break
            if time.monotonic() > deadline:
                return {
                    "drained": False,
                    "node": node,
                    "moved": moved,
                    "remaining": len(units),
                    "reason": f"the deadline of {deadline_s:g}s passed; {node} still serves"
                    f" {len(units)} unit(s)",
                }
            target = self._least_loaded(others)
            try:
                plan = self.state.plan_move(units[0].unit_id, target, reason=f"drain {node}")
            except MoveRefusedError:
                time.sleep(0.1)  # the unit is moving already; look again
                continue
            result = self.run_move(plan)
            moved.append(result)
            if result["phase"] != "done":
                time.sleep(0.2)
        catalog = self.state.node_left(node)
        if catalog is not None:
            self._handles.pop(node, None)
            self.state.profiles.pop(node, None)
            self.broadcast(catalog)
        return {"drained": True, "node": node, "moved": moved, "remaining": 0, "reason": ""}

    def _least_loaded(self, nodes: list[str]) -> str:
        held = Counter(u.node for g in self.state.catalog.groups.values() for u in g.units)
        capacity = {n: float(self.state.profiles.get(n, {}).get("capacity", 1.0)) for n in nodes}
        return min(nodes, key=lambda n: (held[n] / max(capacity[n], 1e-9), n))


def record(state: MigrationState, tables: list[str]) -> dict[str, Any]:
    """A move as ``db.cluster.migrations()`` reports it."""
    plan = state.plan
    return {
        "move_id": plan.move_id,
        "kind": plan.kind,
        "reason": plan.reason,
        "shards": [f"{t}#{s.unit_id}" for t in tables for s in plan.sources],
        "new_shards": [f"{t}#{u.unit_id}" for t in tables for u in plan.targets],
        "from_nodes": sorted({s.node for s in plan.sources}),
        "to_nodes": sorted({u.node for u in plan.targets}),
        "phase": state.phase.value,
        "outcome": state.outcome,
        "started_at": state.started_at,
        "seconds": (state.finished_at or time.time()) - state.started_at,
        "phase_seconds": dict(state.phase_seconds),
        "rows": state.copied_rows,
        "bytes": state.copied_bytes,
        "catch_up_rounds": state.catch_up_rounds,
        "fence_seconds": state.fence_seconds,
        "plan": asdict(plan),
    }
