"""Carries out live moves: drives the pure state machine in ``control/migration.py`` with
calls to the workers (through the worker protocol), persists every transition, and keeps the
history."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

from shardflow.catalog.store import PreparedChange
from shardflow.control import migration
from shardflow.control.admission import MoveBudget
from shardflow.control.migration import (
    BEFORE_SWITCH,
    Action,
    Cancelled,
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
    Phase,
    PrecheckDone,
    RollBack,
    RunPrecheck,
    Switched,
    SwitchRouting,
    VerifyCopy,
)
from shardflow.errors import Error, MoveRefusedError
from shardflow.runtime.coordinator.announce import Announcer
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.protocol import Reply, Worker, Workers

log = logging.getLogger(__name__)
PRECHECK_TIMEOUT_S = 30.0
HEADROOM_FACTOR = 1.5
MAX_ACTIONS = 200
HISTORY = 1000
PACING_STEP_S = 0.1
"""How often a move waiting for its turn (``migration_share``) looks again: whether the
foreground went quiet, or an operator cancelled it."""
UNWRITTEN = frozenset({Phase.FENCE, Phase.VERIFY, Phase.SWITCH})
"""Phases kept in memory only: they pass while writers are held (a write would add to the
pause), and a restarted coordinator does the same found in them as found in CATCH_UP:
whether the catalog switched decides (clean up, or roll back, which unfences the
sources)."""


class Migrator:
    def __init__(
        self,
        state: CoordinatorState,
        workers: Workers,
        announcer: Announcer,
        policy: MigrationPolicy | None = None,
        bandwidth_bytes_s: float = 0.0,
        share: float = 1.0,
    ) -> None:
        self.state = state
        self.workers = workers
        self.announcer = announcer
        self.policy = policy or MigrationPolicy()
        self.bandwidth = bandwidth_bytes_s
        self.budget = MoveBudget(share)
        """The share of the time moves may take while the foreground works."""
        self._budget_lock = threading.Lock()
        self._waiting: dict[str, MovePlan] = {}
        """Moves waiting for their turn (not started yet)."""
        self.folder = state.data_dir.path("migrations")
        state.data_dir.fs.create_dir(self.folder, recursive=True)
        self.history: list[MigrationState] = self._load()
        # a previous coordinator's unfinished moves hold their units until resumed: a new
        # move of one that began meanwhile ran beside the old one's roll-back, which ended
        # the source's export under it (VERIFY then rolled the new one back)
        for unfinished in self.history:
            if not unfinished.done:
                state.reserve_move(unfinished.plan)
        self._promoted: set[str] = set()
        """Moves whose target serves the new shards since its fence (see ``apply_final``)."""
        self._prepared: dict[str, PreparedChange] = {}
        """Moves whose switch's catalog change is written ahead (``prepare_switch``)."""
        self._running: dict[str, MigrationState] = {}
        """The moves being driven now, as they stand."""
        self._cancelled: dict[str, str] = {}
        """Moves an operator cancelled, and who (they roll back at their next step)."""

    # -- persistence -----------------------------------------------------------------------
    def _load(self) -> list[MigrationState]:
        found = []
        for name in self.state.data_dir.list(self.folder):
            if name.endswith(".json"):
                try:
                    data = json.loads(self.state.data_dir.read(f"{self.folder}/{name}"))
                    found.append(migration.from_json(data))
                except (ValueError, KeyError, TypeError):
                    log.warning("unreadable migration record %s", name)
        return sorted(found, key=lambda m: m.started_at)[-HISTORY:]

    def _persist(self, state: MigrationState) -> None:
        if state.phase not in UNWRITTEN:
            payload = json.dumps(migration.to_json(state)).encode()
            # not fsync'ed: after a machine crash an older phase is found, which rolls back
            # (or, past the switch the fsync'ed catalog records, cleans up) the same way
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
        try:
            waited = self._wait_for_turn(plan)
            state, actions = migration.start(plan, time.time())
            if waited:  # the move's own time starts now; the wait is told apart
                state = dataclasses.replace(state, phase_seconds={"paced": waited})
            started = time.monotonic()
            try:
                return self._drive(state, actions)
            finally:
                with self._budget_lock:
                    self.budget.moved(time.monotonic() - started, time.monotonic())
        finally:
            self.state.finish_move(plan)

    def foreground(self) -> None:
        """Queries or inserts finished just now (the sessions' reports)."""
        with self._budget_lock:
            self.budget.foreground(time.monotonic())

    def _wait_for_turn(self, plan: MovePlan) -> float:
        """Wait until the moves before this one fit ``migration_share`` of the time (none
        while the foreground is quiet; a drain's moves never wait: the operator wants the
        node out); returns the seconds waited. A cancel ends the wait (the move then rolls
        back at its first step)."""
        if plan.reason.startswith("drain "):
            return 0.0
        began = time.monotonic()
        slept = False
        self._waiting[plan.move_id] = plan
        try:
            while plan.move_id not in self._cancelled:
                with self._budget_lock:
                    wait = self.budget.wait_before(time.monotonic())
                if wait <= 0:
                    break
                time.sleep(min(wait, PACING_STEP_S))
                slept = True
        finally:
            self._waiting.pop(plan.move_id, None)
        if not slept:
            return 0.0
        waited = time.monotonic() - began
        with self._budget_lock:
            self.budget.waited += waited
        log.info("move %s waited %.2f s for its turn (migration_share)", plan.move_id, waited)
        return waited

    def running_moves(self, reason: str) -> list[str]:
        """The moves being driven now for ``reason`` (a drain's: "drain <node>")."""
        return [m for m, state in list(self._running.items()) if state.plan.reason == reason]

    def cancel(self, move_id: str, by: str = "an operator") -> MigrationState:
        """Roll a running move back (its copy stops at its next chunk, any later phase at
        its next step, the source serving throughout); returns the move as it stands.
        Refused for a move not running; one past its switch ends as it would (nothing is
        left to undo)."""
        waiting = self._waiting.get(move_id)
        if waiting is not None:  # not started: it rolls back at its first step
            self._cancelled[move_id] = by
            return migration.start(waiting, time.time())[0]
        state = self._running.get(move_id)
        if state is None:
            done = next((m for m in self.history if m.plan.move_id == move_id), None)
            if done is not None:
                raise MoveRefusedError(f"move {move_id} has ended already ({done.outcome})")
            raise MoveRefusedError(f"no move {move_id}; see db.cluster.migrations()")
        if state.phase not in BEFORE_SWITCH:
            raise MoveRefusedError(f"move {move_id} has switched already: it ends as it would")
        self._cancelled[move_id] = by
        try:
            self._target(state.plan).cancel_import(move_id).get(PRECHECK_TIMEOUT_S)
        except Error as error:  # its target is gone: the move fails anyway
            log.info("cancelling the copy of %s: %s", move_id, error)
        return state

    def resume_unfinished(self) -> list[MigrationState]:
        """After a coordinator restart: finish switched moves, roll back the others."""
        finished = []
        for state in list(self.history):
            if state.done:
                continue
            try:
                switched = self.state.switched(state.plan)
                resumed, actions = migration.resume(state, switched, time.time())
                finished.append(self._drive(resumed, actions))
            finally:  # its units may move again
                self.state.finish_move(state.plan)
        return finished

    def _drive(self, state: MigrationState, actions: list[Action]) -> MigrationState:
        move_id = state.plan.move_id
        try:
            return self._steps(state, actions)
        finally:
            self._running.pop(move_id, None)
            self._cancelled.pop(move_id, None)
            prepared = self._prepared.pop(move_id, None)
            if prepared is not None:  # not switched: rolled back, or failed
                self.state.discard(prepared)

    def _steps(self, state: MigrationState, actions: list[Action]) -> MigrationState:
        self._persist(state)
        move_id = state.plan.move_id
        for _ in range(MAX_ACTIONS):
            self._running[move_id] = state
            if not actions:
                break
            if move_id in self._cancelled and state.phase in BEFORE_SWITCH:
                event: Event | None = Cancelled(f"by {self._cancelled[move_id]}")
            else:
                event = self._carry_out(state, actions[0])
                if isinstance(event, Failed) and move_id in self._cancelled:
                    event = Cancelled(f"by {self._cancelled[move_id]}")  # its copy stopped
            if event is None:
                break
            state, actions = migration.step(state, event, time.time(), self.policy)
            self._persist(state)
        if state.done:
            log.info("move %s %s: %s", state.plan.move_id, state.plan.kind, state.outcome)
        return state

    def _carry_out(self, state: MigrationState, action: Action) -> Event | None:
        """Do what ``action`` says; what happened, as the event the state machine takes next
        (None once a roll-back is done). Every worker error becomes ``Failed``."""
        plan = state.plan
        try:
            if isinstance(action, RunPrecheck):
                return self._precheck(plan)
            if isinstance(action, CopySnapshot):
                copied = self._target(plan).copy_snapshot(plan, self.bandwidth).get()
                return Copied(copied.rows, copied.bytes)
            if isinstance(action, CatchUp):
                return CaughtUp(self._target(plan).catch_up(plan.move_id).get())
            if isinstance(action, FenceWrites):
                return self._fence(plan)
            if isinstance(action, VerifyCopy):
                return self._verify(action)
            if isinstance(action, SwitchRouting):
                return self._switch(plan)
            if isinstance(action, CleanUpSource):
                if action.hand_over:
                    self._retire_sources(plan)
                self.announcer.announce(plan.nodes)  # writers are free again already
                for reply in [w.drop_retired(plan.move_id) for w in self._sources(plan)]:
                    reply.get()
                return CleanedUp()
            if isinstance(action, RollBack):
                self._roll_back(plan)
                return None
        except Error as error:
            return Failed(f"{type(error).__name__}: {error}")
        raise AssertionError(f"unknown action {action}")  # pragma: no cover

    def _precheck(self, plan: MovePlan) -> Event:
        nodes = set(self.state.catalog.nodes)
        for node in plan.nodes:
            if node not in nodes:
                return PrecheckDone(False, f"{node} is not a live node")
        size = 0
        for source in self._sources(plan):
            units = [s.unit_id for s in plan.sources if s.node == source.node_id]
            size += source.unit_bytes(units).get(PRECHECK_TIMEOUT_S)
        target = self._target(plan)
        free = target.memory_headroom().get(PRECHECK_TIMEOUT_S)
        if free < HEADROOM_FACTOR * size:
            return PrecheckDone(
                False, f"{target.node_id} has {free} bytes free, the move needs {size}"
            )
        return PrecheckDone(True)

    def _fence(self, plan: MovePlan) -> Event:
        """The target fences every source (each holds writes and hands out its last
        changes with its final checksums, in one answer), applies those changes and
        answers with what the sources said and the checksums of what it stores.
        ``Fenced`` carries both sides to VERIFY. The switch's catalog change is written
        ahead first: writers then wait for its rename, not for its sync."""
        prepared = self.state.prepare_switch(plan)
        if prepared is not None:
            self._prepared[plan.move_id] = prepared
        final = self._target(plan).finish_import(plan.move_id).get()
        if final.promoted:
            self._promoted.add(plan.move_id)
        return Fenced(final.rows, final.handed_out, final.stored)

    def _verify(self, action: VerifyCopy) -> Event:
        """Rows and checksums the fenced sources handed out (snapshot and every change
        since) against what the target stores (its snapshot as stored, and every change it
        applied): a mismatch rolls the move back."""
        return migration.verify_copy(action.handed_out, action.stored)

    def _switch(self, plan: MovePlan) -> Event:
        if plan.move_id not in self._promoted:  # e.g. a switch retried: promote is idempotent
            self._target(plan).promote(plan.move_id).get()
        self._promoted.discard(plan.move_id)
        self.state.apply_switch(plan, self._prepared.pop(plan.move_id, None))
        # writers held by the fence are told Moved from here
        return Switched(self._retire_sources(plan))

    def _retire_sources(self, plan: MovePlan) -> float | None:
        """The sources stop serving what moved (idempotent); the longest any held writers
        (None where none said: retired already)."""
        held = [reply.get() for reply in [w.retire(plan.move_id) for w in self._sources(plan)]]
        return max((s for s in held if s is not None), default=None)

    def _roll_back(self, plan: MovePlan) -> None:
        """The target drops its copy, then the sources serve writes again (at once, all of
        them): a target promoted already ends its claim of the shards before a source
        claims them back. A worker that is gone has nothing to undo."""
        self._promoted.discard(plan.move_id)
        self._ask_all([lambda: self._target(plan).abort_import(plan.move_id)], plan.move_id)
        calls: list[Callable[[], Reply[None]]] = [
            partial(self._abort_export, node, plan.move_id) for node in self._source_nodes(plan)
        ]
        self._ask_all(calls, plan.move_id)

    @staticmethod
    def _ask_all(calls: list[Callable[[], Reply[None]]], move_id: str) -> None:
        replies = []
        for call in calls:
            try:
                replies.append(call())
            except Error as error:
                log.info("roll-back step of %s skipped: %s", move_id, error)
        for reply in replies:
            try:
                reply.get(PRECHECK_TIMEOUT_S)
            except Error as error:
                log.info("roll-back step of %s skipped: %s", move_id, error)

    def _abort_export(self, node: str, move_id: str) -> Reply[None]:
        return self.workers.get(node).abort_export(move_id)

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _source_nodes(plan: MovePlan) -> list[str]:
        return sorted({s.node for s in plan.sources})

    @staticmethod
    def _target_node(plan: MovePlan) -> str:
        nodes = {t.node for t in plan.targets}
        assert len(nodes) == 1, "every target of a move is on one node"
        return nodes.pop()

    def _target(self, plan: MovePlan) -> Worker:
        return self.workers.get(self._target_node(plan))

    def _sources(self, plan: MovePlan) -> list[Worker]:
        return [self.workers.get(node) for node in self._source_nodes(plan)]


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
