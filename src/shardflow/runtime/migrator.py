"""Carries out live moves: drives the pure state machine in ``control/migration.py`` with
calls to the workers, persists every transition, and keeps the history."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from shardflow.control import migration
from shardflow.control.migration import (
    Action,
    CatchUp,
    CaughtUp,
    CleanedUp,
    CleanUpSource,
    Copied,
    CopySnapshot,
    Event,
    Failed,
    Fenced,
    FenceWrites,
    MigrationPolicy,
    MigrationState,
    MovePlan,
    PrecheckDone,
    RollBack,
    RunPrecheck,
    Switched,
    SwitchRouting,
    Verified,
    VerifyCopy,
)
from shardflow.errors import Error
from shardflow.runtime.coordinator import CoordinatorState

log = logging.getLogger(__name__)
PRECHECK_TIMEOUT_S = 30.0
HEADROOM_FACTOR = 1.5
MAX_ACTIONS = 200
HISTORY = 1000


@dataclass
class MoveStats:
    """Counters the metrics endpoint and the benchmarks read."""

    outcomes: Counter[str]
    fence_seconds: list[float]
    durations: list[float]


class Migrator:
    def __init__(
        self,
        state: CoordinatorState,
        worker: Callable[[str], Any],
        policy: MigrationPolicy | None = None,
        bandwidth_bytes_s: float = 0.0,
    ) -> None:
        self.state = state
        self.worker = worker
        self.policy = policy or MigrationPolicy()
        self.bandwidth = bandwidth_bytes_s
        self.folder = state.data_dir.path("migrations")
        state.data_dir.fs.create_dir(self.folder, recursive=True)
        self.history: list[MigrationState] = self._load()
        self.stats = MoveStats(Counter(), [], [])
        self._fenced: dict[str, list[tuple[str, Any, dict[str, list[int]]]]] = {}
        """Per move under the fence: each source's last changes and final checksums."""
        self._target_sums: dict[str, dict[str, list[int]]] = {}

    # -- persistence -----------------------------------------------------------------------
    def _load(self) -> list[MigrationState]:
        found = []
        for name in self.state.data_dir.list(self.folder):
            if name.endswith(".json"):
                try:
                    data = json.loads(self.state.data_dir.read(f"{self.folder}/{name}"))
                    found.append(migration.from_json(data))
                except (ValueError, KeyError):
                    log.warning("unreadable migration record %s", name)
        return sorted(found, key=lambda m: m.started_at)[-HISTORY:]

    def _persist(self, state: MigrationState) -> None:
        payload = json.dumps(migration.to_json(state)).encode()
        # not fsync'ed: after a machine crash an older phase is found, which rolls back (or,
        # past the switch that the fsync'ed catalog records, cleans up) exactly the same way
        path = f"{self.folder}/{state.plan.move_id}.json"
        self.state.data_dir.write_atomic(path, payload, sync=False)
        for index, known in enumerate(self.history):
            if known.plan.move_id == state.plan.move_id:
                self.history[index] = state
                break
        else:
            self.history.append(state)
            del self.history[:-HISTORY]

    # -- running ------------------------------------------------------------------------
    def run(self, plan: MovePlan) -> MigrationState:
        state, actions = migration.start(plan, time.time())
        try:
            return self._drive(state, actions)
        finally:
            self.state.finish_move(plan)

    def resume_unfinished(self) -> list[MigrationState]:
        """After a coordinator restart: finish switched moves, roll back the others."""
        finished = []
        for state in list(self.history):
            if state.done:
                continue
            resumed, actions = migration.resume(state, self.state.switched(state.plan), time.time())
            finished.append(self._drive(resumed, actions))
        return finished

    def _drive(self, state: MigrationState, actions: list[Action]) -> MigrationState:
        self._persist(state)
        for _ in range(MAX_ACTIONS):
            if not actions:
                break
            event = self._carry_out(state, actions[0])
            if event is None:
                break
            state, actions = migration.step(state, event, time.time(), self.policy)
            self._persist(state)
        if state.done:
            self.stats.outcomes[
                "done" if state.phase == migration.Phase.DONE else "rolled_back"
            ] += 1
            self.stats.fence_seconds.append(state.fence_seconds)
            self.stats.durations.append((state.finished_at or time.time()) - state.started_at)
            log.info("move %s %s: %s", state.plan.move_id, state.plan.kind, state.outcome)
        return state

    def _carry_out(self, state: MigrationState, action: Action) -> Event | None:
        plan = state.plan
        try:
            if isinstance(action, RunPrecheck):
                return self._precheck(plan)
            if isinstance(action, CopySnapshot):
                rows, size = ray.get(
                    self._target(plan).pull_snapshot.remote(
                        migration.to_json(state)["plan"], self._sources(plan), self.bandwidth
                    )
                )
                return Copied(rows, size)
            if isinstance(action, CatchUp):
                rows = ray.get(
                    self._target(plan).catch_up.remote(plan.move_id, self._sources(plan))
                )
                return CaughtUp(rows)
            if isinstance(action, FenceWrites):
                ray.get(
                    [self.worker(n).fence.remote(plan.move_id) for n in self._source_nodes(plan)]
                )
                return Fenced()
            if isinstance(action, VerifyCopy):
                return self._verify(plan)
            if isinstance(action, SwitchRouting):
                return self._switch(plan)
            if isinstance(action, CleanUpSource):
                ray.get(
                    [
                        self.worker(n).drop_retired.remote(plan.move_id)
                        for n in self._source_nodes(plan)
                    ]
                )
                return CleanedUp()
            if isinstance(action, RollBack):
                self._roll_back(plan)
                return None
        except (RayActorError, RayTaskError, GetTimeoutError, Error, ValueError) as error:
            cause = error.cause if isinstance(error, RayTaskError) else error
            return Failed(f"{type(cause).__name__}: {cause}")
        raise AssertionError(f"unknown action {action}")  # pragma: no cover

    def _precheck(self, plan: MovePlan) -> Event:
        nodes = set(self.state.catalog.nodes)
        for node in plan.nodes:
            if node not in nodes:
                return PrecheckDone(False, f"{node} is not a live node")
        size = 0
        for node in self._source_nodes(plan):
            units = [s.unit_id for s in plan.sources if s.node == node]
            size += ray.get(self.worker(node).unit_bytes.remote(units), timeout=PRECHECK_TIMEOUT_S)
        target = self._target_node(plan)
        free = ray.get(self.worker(target).memory_headroom.remote(), timeout=PRECHECK_TIMEOUT_S)
        if free < HEADROOM_FACTOR * size:
            return PrecheckDone(False, f"{target} has {free} bytes free, the move needs {size}")
        return PrecheckDone(True)

    def _verify(self, plan: MovePlan) -> Event:
        """Rows and checksums the fenced sources handed out (snapshot and every change
        since) against what the target stored. Both sides kept running totals while they
        copied; nothing is hashed or asked for here."""
        source: dict[str, list[int]] = {}
        for node, _, sums in self._fenced.pop(plan.move_id, []):
            for table, (rows, digest, held) in sums.items():
                if rows != held:
                    return Verified(False, f"{table}: {node} holds {held} rows, sent {rows}")
                total = source.setdefault(table, [0, 0])
                total[0] += rows
                total[1] += digest
        target = self._target_sums.pop(plan.move_id, {})
        for table in sorted(set(source) | set(target)):
            have, want = target.get(table, [0, 0]), source.get(table, [0, 0])
            if have != want:
                same_hash = have[1] == want[1]
                return Verified(
                    False,
                    f"{table}: sources {want[0]} rows, target {have[0]} rows"
                    f" (checksums {'equal' if same_hash else 'differ'})",
                )
        return Verified(True)

    def _switch(self, plan: MovePlan) -> Event:
        target = self._target(plan)
        ray.get(target.promote.remote(plan.move_id))
        catalog = self.state.apply_switch(plan)
        ray.get(self._on_sources(plan, "retire"))
        for node in self.state.catalog.nodes:  # routing news; the session learns on its own
            try:
                self.worker(node).sync.remote(catalog)
            except Error:
                pass
        return Switched()

    def _roll_back(self, plan: MovePlan) -> None:
        self._fenced.pop(plan.move_id, None)
        self._target_sums.pop(plan.move_id, None)
        calls = [self._target(plan).abort_import.remote(plan.move_id)]
        calls += [
            self.worker(n).abort_export.remote(plan.move_id) for n in self._source_nodes(plan)
        ]
        for call in calls:
            try:
                ray.get(call, timeout=PRECHECK_TIMEOUT_S)
            except (RayActorError, RayTaskError, GetTimeoutError) as error:
                log.info("roll-back step of %s skipped: %s", plan.move_id, error)

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _source_nodes(plan: MovePlan) -> list[str]:
        return sorted({s.node for s in plan.sources})

    @staticmethod
    def _target_node(plan: MovePlan) -> str:
        nodes = {t.node for t in plan.targets}
        assert len(nodes) == 1, "every target of a move is on one node"
        return nodes.pop()

    def _on_sources(self, plan: MovePlan, method: str) -> list[Any]:
        """Call ``method(move_id)`` on every source node; the object references."""
        return [
            getattr(self.worker(node), method).remote(plan.move_id)
            for node in self._source_nodes(plan)
        ]

    def _target(self, plan: MovePlan) -> Any:
        return self.worker(self._target_node(plan))

    def _sources(self, plan: MovePlan) -> dict[str, Any]:
        return {node: self.worker(node) for node in self._source_nodes(plan)}
