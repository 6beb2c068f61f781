"""The coordinator's active side: it watches the workers (failover), runs live moves, drains
nodes and, every poll interval, asks the balancer what to do. Decisions come from the pure
policies in ``control/``; this module only turns them into worker calls (through the worker
protocol, so it runs on Ray and, in tests, on in-process workers alike)."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from shardflow.config import Settings
from shardflow.control import balancer, cost, forecast
from shardflow.control.health import HealthSettings, HealthTracker, Transition
from shardflow.control.migration import MigrationPolicy, MigrationState, MovePlan
from shardflow.errors import (
    DataDirInUseError,
    Error,
    MoveRefusedError,
    StorageError,
    UnknownShardError,
    WorkerGone,
)
from shardflow.runtime.coordinator.announce import Announcer
from shardflow.runtime.coordinator.migrator import Migrator, record
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.protocol import (
    DrainReport,
    LoadReport,
    NodeLoad,
    Reply,
    ShardKey,
    Workers,
)
from shardflow.telemetry.devices import device_model
from shardflow.telemetry.metrics import Recorder

log = logging.getLogger(__name__)
HISTORY_FILE = "load_history.json"
RECENT_MOVES = 20
"""Moves whose speed tells how long the next ones take."""


@dataclass(frozen=True)
class Failover:
    node: str
    detected_at: float
    units: int
    seconds: float
    """From detection until every new owner served the reassigned shards."""


class Controller:
    def __init__(self, state: CoordinatorState, workers: Workers, settings: Settings) -> None:
        self.state = state
        self.workers = workers
        self.settings = settings
        self.announcer = Announcer(state, workers, settings.retry_deadline_s)
        """Tells the nodes a move touched of the catalog's change."""
        self.migrator = Migrator(
            state,
            workers,
            self.announcer,
            MigrationPolicy(),
            bandwidth_bytes_s=settings.migration_bandwidth_mb_s * 1e6,
            share=settings.migration_share,
        )
        self.failovers: list[Failover] = []
        self.decisions: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._balancing = threading.Lock()
        self.balancer_paused = threading.Event()
        """Set while an operator paused the balancer (``pause_balancer``)."""
        self._drains: dict[str, threading.Event] = {}
        """The drains running, by node: set to stop one (``cancel_drain``)."""
        self._last_reports: dict[str, LoadReport] = {}
        self._previous_load: float | None = None
        self._unbalanced_polls = 0
        self.utilization: dict[str, float] = {}
        self.shard_load: dict[ShardKey, float] = {}
        """Each shard's execution seconds per second over the last observed window."""
        self.recorder: Recorder | None = None
        self._adopting = False
        self._catching_up: threading.Thread | None = None
        """Telling nodes whose catalog version is not known the catalog (``_watch``)."""
        self.health = HealthTracker(
            HealthSettings(
                threshold=settings.node_failure_rate,
                min_operations=settings.node_failure_min_ops,
                window_s=settings.node_failure_window_s,
                cooldown_s=settings.suspect_cooldown_s,
            )
        )
        self.health_changes: list[dict[str, Any]] = []
        """The last changes of node health (suspect, re-admitted, failing), newest last."""
        self.load_history = self._load_history()
        """Each unit's load by time of day, for predictive balancing."""
        self._history_lock = threading.Lock()
        self._history_saved = time.time()

    # -- workers ------------------------------------------------------------------------
    def broadcast(self, wait: bool = True) -> None:
        """Tell every live worker of a catalog change that concerns them all (a node gone,
        joined or excluded): each is told the changes since the version it serves, or the
        catalog whole (``announce.py``), and loads what is now its own. Without ``wait``
        this happens on a thread of its own (a node that hangs holds nothing up)."""
        nodes = list(self.state.catalog.nodes)
        if wait:
            self.announcer.announce(nodes)
            return
        threading.Thread(
            target=self.announcer.announce, args=(nodes,), name="announce", daemon=True
        ).start()

    # -- failover -----------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._resume, name="resume", daemon=True).start()
        threading.Thread(target=self._watch, name="monitor", daemon=True).start()
        threading.Thread(target=self._balance_loop, name="balancer", daemon=True).start()
        threading.Thread(target=self._keep_lease, name="lease", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> threading.Event:
        """Set once the controller stops (its loops, and the coordinator's, end)."""
        return self._stop

    def _keep_lease(self) -> None:
        """Renew the data directory's lease; once another cluster has taken it over, stop
        acting (the workers' writes are refused by then anyway)."""
        while not self._stop.wait(self.settings.lease_ttl_s / 4):
            try:
                if not self.state.renew_lease():
                    log.error("another cluster took over the data directory; stopping")
                    self._stop.set()
            except (OSError, StorageError, DataDirInUseError) as error:  # a flaky or full
                # filesystem, or a frozen process holding the lease's lock: the next may work
                log.warning("renewing the data directory lease failed: %s", error)

    def _resume(self) -> None:
        try:
            for result in self.resume():
                log.info("resumed move %s: %s", result["move_id"], result["outcome"])
        except Exception:  # a resume must never take the coordinator down
            log.exception("resuming unfinished moves failed")

    def resume(self) -> list[dict[str, Any]]:
        """Finish (past the switch) or roll back the moves a previous coordinator left
        unfinished; each is recorded and counted as any move is."""
        return [self._finished(state) for state in self.migrator.resume_unfinished()]

    def adopt(self) -> None:
        """This coordinator restarted (its node was lost): the members' profiles died with
        the old one. From now on, members without one are asked for it by the watch loop,
        which watches them again, or fails them over if their worker is gone too."""
        self._adopting = True

    def _adopt_members(self) -> None:
        pending = [n for n in self.state.catalog.nodes if n not in self.state.profiles]
        for node in pending:
            try:
                info = self.workers.get(node).info().get(timeout=self.settings.retry_deadline_s)
            except WorkerGone:
                log.warning("%s was lost with the old coordinator's node", node)
                self.fail_node(node)
                continue
            except Error as error:  # slow: asked again next round
                log.info("%s did not report yet: %s", node, error)
                continue
            self.state.report_profile(info.profile)
        self._adopting = any(n not in self.state.profiles for n in self.state.catalog.nodes)

    def _watch(self) -> None:
        misses: Counter[str] = Counter()
        while not self._stop.wait(self.settings.health_interval_s):
            if self._adopting:
                self._adopt_members()
            watched = [n for n in self.state.catalog.nodes if n in self.state.profiles]
            pings: dict[str, Reply[bool]] = {}
            for node in watched:
                try:
                    pings[node] = self.workers.get(node).ping()
                except WorkerGone:
                    misses[node] = self.settings.health_misses
            for node, reply in pings.items():
                try:
                    reply.get(timeout=self.settings.health_interval_s)
                    misses[node] = 0
                    self.health.record(node, time.monotonic(), 1, 0)
                except WorkerGone:
                    misses[node] = self.settings.health_misses  # died: no doubt about it
                except Error:  # no answer in time (or a confused one): a miss
                    misses[node] += 1
                    self.health.record(node, time.monotonic(), 1, 1)
            for node in watched:
                if misses[node] >= self.settings.health_misses:
                    misses.pop(node)
                    self.fail_node(node)
            self._catch_up([n for n in watched if misses[n] == 0])

    def _catch_up(self, nodes: list[str]) -> None:
        """Send the catalog whole to those of ``nodes`` (answering pings) that did not take
        a change (its answer lost, an error): such a node would otherwise stay behind until
        the next change that concerns it, saying ``Moved`` to every query of what changed
        meanwhile. On a thread of its own, one at a time (a node slow to take it holds up
        no ping)."""
        unknown = self.announcer.forgotten(nodes)
        if not unknown or (self._catching_up is not None and self._catching_up.is_alive()):
            return
        self._catching_up = threading.Thread(
            target=self.announcer.announce, args=(unknown,), name="catch-up", daemon=True
        )
        self._catching_up.start()

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
        self.health.forget(node)
        self.workers.fence(node)  # declared dead: it must not go on serving, if it still runs
        self.state.profiles.pop(node, None)
        self.broadcast()
        record = Failover(node, detected, units, time.time() - detected)
        self.failovers.append(record)
        return record

    # -- moves --------------------------------------------------------------------------
    def run_move(self, plan: MovePlan) -> dict[str, Any]:
        return self._finished(self.migrator.run(plan))

    def _finished(self, state: MigrationState) -> dict[str, Any]:
        plan = state.plan
        if state.outcome.startswith("done") and plan.kind != "move":  # a move keeps its ids
            self._carry_history(plan)
        result = record(state, self.state.catalog.group_tables(plan.group))
        if self.recorder is not None:
            self.recorder.move(result)
        return result

    def move_s_per_byte(self) -> float:
        """How long moves take now: the median over the last moves done (0 before any)."""
        recent = [
            (state.finished_at - state.started_at) / state.copied_bytes
            for state in self.migrator.history[-RECENT_MOVES:]
            if state.outcome == "done" and state.copied_bytes > 0 and state.finished_at is not None
        ]
        return statistics.median(recent) if recent else 0.0

    def history(self) -> list[dict[str, Any]]:
        catalog = self.state.catalog
        return [
            record(state, catalog.group_tables(state.plan.group)) for state in self.migrator.history
        ]

    def drain(self, node: str, deadline_s: float) -> DrainReport:
        """Move every unit off ``node`` live; then it leaves. Past the deadline, stop and
        leave the node serving what it still holds."""
        if node not in self.state.catalog.nodes:
            raise UnknownShardError(f"{node!r} is not a node of the cluster")
        others = [n for n in self.state.catalog.nodes if n != node]
        if not others:
            raise MoveRefusedError(f"{node} is the last node; nothing could take its shards")
        deadline = time.monotonic() + deadline_s
        moved: list[dict[str, Any]] = []
        stop = self._drains.setdefault(node, threading.Event())
        stop.clear()
        try:
            return self._drain(node, others, deadline, deadline_s, moved, stop)
        finally:
            self._drains.pop(node, None)

    def _drain(
        self,
        node: str,
        others: list[str],
        deadline: float,
        deadline_s: float,
        moved: list[dict[str, Any]],
        stop: threading.Event,
    ) -> DrainReport:
        while True:
            units = [
                u for g in self.state.catalog.groups.values() for u in g.units if u.node == node
            ]
            if not units:
                break
            stopped = (
                "the drain was cancelled by an operator"
                if stop.is_set()
                else f"the deadline of {deadline_s:g}s passed"
                if time.monotonic() > deadline
                else None
            )
            if stopped is not None:
                return DrainReport(
                    drained=False,
                    node=node,
                    moved=tuple(moved),
                    remaining=len(units),
                    reason=f"{stopped}; {node} still serves {len(units)} unit(s)",
                    cancelled=stop.is_set(),
                )
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
            self.workers.forget(node)
            self.state.profiles.pop(node, None)
            self.broadcast()
        return DrainReport(drained=True, node=node, moved=tuple(moved), remaining=0, reason="")

    # -- reports ------------------------------------------------------------------------
    def node_loads(self) -> dict[str, NodeLoad]:
        """Per node: the busy fraction over the last observed window and the capacity that
        placement and the balancer use (relative to the median node)."""
        nodes = list(self.state.catalog.nodes)
        capacities = self.state.capacities(nodes)
        now = time.monotonic()
        return {
            n: NodeLoad(
                self.utilization.get(n),
                capacities[n],
                self.health.health(n).value,
                self.health.rate(n, now)[0],
            )
            for n in nodes
        }

    # -- balancing ----------------------------------------------------------------------
    def balancer_settings(self) -> balancer.BalancerSettings:
        s = self.settings
        return balancer.BalancerSettings(
            utilization_threshold=s.utilization_threshold,
            tolerance=s.balance_tolerance,
            load_swing=s.load_swing,
            max_moves=s.max_concurrent_moves,
            max_unit_bytes=s.max_shard_bytes,
            min_unit_bytes=s.min_shard_bytes,
        )

    def observe(self) -> tuple[list[balancer.NodeState], list[balancer.UnitState]]:
        """Per-node and per-unit load over the window since the last observation."""
        catalog = self.state.catalog
        replies: dict[str, Reply[LoadReport]] = {}
        for node in catalog.nodes:
            try:
                replies[node] = self.workers.get(node).load_report()
            except WorkerGone:
                continue
        reports: dict[str, LoadReport] = {}
        for node, reply in replies.items():
            try:
                reports[node] = reply.get(timeout=self.settings.retry_deadline_s)
            except Error:
                continue
        speeds = self.speeds(list(reports))
        nodes, units = [], []
        for node, report in reports.items():
            before = self._last_reports.get(node)
            window = report.at - before.at if before else 0.0

            def rate(now: float, then: float, w: float = window) -> float:
                return max(0.0, now - then) / w if w > 0 else 0.0

            self._record_health(node, report, before)
            busy = rate(report.busy_seconds, before.busy_seconds) if before else 0.0
            device = report.device_utilization
            self.utilization[node] = busy
            # the device's own utilisation where telemetry has it, else the busy fraction
            utilization = max(busy, device) if device is not None else busy
            nodes.append(
                balancer.NodeState(
                    node,
                    1.0,
                    utilization=utilization,
                    speeds=speeds[node],
                    memory=report.memory_budget,
                )
            )
            for group in catalog.groups.values():
                for unit in group.units:
                    if unit.node != node:
                        continue
                    now = report.unit_seconds.get(unit.unit_id, {})
                    then = before.unit_seconds.get(unit.unit_id, {}) if before else now
                    # execution seconds per second by operator, measured on this node; the
                    # balancer counts them in the median node's seconds
                    spent = {op: rate(s, then.get(op, 0.0)) for op, s in now.items()}
                    mix = {op: s for op, s in spent.items() if s > 0}
                    units.append(
                        balancer.UnitState(
                            unit.unit_id,
                            group.group_id,
                            node,
                            unit.lo,
                            unit.hi,
                            int(report.unit_bytes.get(unit.unit_id, 0)),
                            cost.reference_load(mix, speeds[node]),
                            mix,
                        )
                    )
        self.shard_load = shard_rates(reports, self._last_reports)
        self.state.operator_mix = operator_shares(reports, self._last_reports)
        capacities = self.state.capacities([n.node for n in nodes])
        nodes = [replace(n, capacity=capacities[n.node]) for n in nodes]
        self._last_reports = reports
        return nodes, units

    def speeds(self, nodes: list[str]) -> dict[str, dict[str, float]]:
        """Each node's calibrated throughput per operator relative to the median node's."""
        profiles = self.state.profiles
        calibrations = {n: dict(profiles[n].calibration) if n in profiles else {} for n in nodes}
        models = {n: device_model(profiles[n]) if n in profiles else n for n in nodes}
        return cost.relative_speeds(calibrations, models)

    def _record_health(self, node: str, report: LoadReport, before: LoadReport | None) -> None:
        """What the node did and failed since its last report (a device's new uncorrectable
        errors count as failed operations)."""
        operations = report.operations - (before.operations if before else 0)
        failures = report.failures - (before.failures if before else 0)
        if report.device_errors is not None and before and before.device_errors is not None:
            errors = max(0, report.device_errors - before.device_errors)
            operations, failures = operations + errors, failures + errors
        self.health.record(node, time.monotonic(), operations, failures)

    def follow_health(self) -> list[Transition]:
        """Apply the changes of node health due now: suspect and failing nodes get no new
        units (the balancer moves theirs off), re-admitted ones get units again."""
        changes = self.health.evaluate(time.monotonic())
        if self.state.exclude(self.health.excluded()):  # sessions send no work there now
            self.broadcast(wait=False)
        for change in changes:
            log.warning("node %s: %s -> %s (%s)", change.node, change.before.value,
                        change.after.value, change.reason)  # fmt: skip
            self.health_changes.append(
                {"node": change.node, "from": change.before.value, "to": change.after.value,
                 "reason": change.reason, "at": time.time()}
            )  # fmt: skip
        del self.health_changes[:-100]
        return changes

    def decide(self) -> balancer.Decision:
        windowed = bool(self._last_reports)  # the first observation opens the window
        nodes, units = self.observe()
        self.follow_health()
        now = time.time()
        with self._history_lock:
            if units and windowed:
                self.load_history.observe(now, {u.unit_id: u.load for u in units})
                self._keep_history(now)
        busy = frozenset(u.unit_id for plan in self.state.moving.values() for u in plan.sources)
        settings = self.balancer_settings()
        if self.settings.predictive_balancing:
            with self._history_lock:
                decision = forecast.plan_ahead(
                    nodes, units, self.load_history, now, settings, self._previous_load, busy,
                    self.state.excluded, self.move_s_per_byte(),
                )  # fmt: skip
        else:
            decision = balancer.plan(
                nodes, units, settings, self._previous_load, busy, excluded=self.state.excluded
            )
        self._previous_load = decision.total_load
        return decision

    # -- load history -------------------------------------------------------------------
    def _history_path(self) -> str:
        return self.state.data_dir.path("balancer", HISTORY_FILE)

    def _load_history(self) -> forecast.LoadHistory:
        """The load history kept in the data directory (none: an empty one)."""
        kept = forecast.ForecastSettings(
            period_s=self.settings.forecast_period_s, slots=self.settings.forecast_slots
        )
        try:
            data = json.loads(self.state.data_dir.read(self._history_path()))
            return forecast.LoadHistory.from_json(data, kept)
        except FileNotFoundError:
            return forecast.LoadHistory(kept)
        except (OSError, ValueError, TypeError, AttributeError) as error:  # torn or foreign
            log.warning("the kept load history cannot be read (%s); starting a new one", error)
            return forecast.LoadHistory(kept)

    def _carry_history(self, plan: MovePlan) -> None:
        """The units a split or merge made start with their sources' load history (a
        split's halves half of it each, a merge's unit the sum)."""
        sources = [s.unit_id for s in plan.sources]
        with self._history_lock:
            for target in plan.targets:
                self.load_history.inherit(target.unit_id, sources, 1.0 / len(plan.targets))
            self.load_history.forget(sources)

    def _keep_history(self, now: float, force: bool = False) -> None:
        """Write the load history to the data directory once per forecast slot (a restarted
        coordinator loses at most a slot of it)."""
        if not force and now - self._history_saved < self.load_history.settings.slot_s:
            return
        live = {u.unit_id for g in self.state.catalog.groups.values() for u in g.units}
        self.load_history.forget([u for u in self.load_history.units if u not in live])
        payload = json.dumps(self.load_history.to_json()).encode()
        self.state.data_dir.write_atomic(self._history_path(), payload)
        self._history_saved = now

    def cancel_drain(self, node: str) -> bool:
        """Stop the drain of ``node`` before its next move (its running one is rolled back
        where it has not switched yet): the node stays and serves what it still holds.
        Answers whether a drain of it was running."""
        stop = self._drains.get(node)
        if stop is None:
            return False
        stop.set()
        for move_id in self.migrator.running_moves(reason=f"drain {node}"):
            with contextlib.suppress(MoveRefusedError):  # ended or switched meanwhile
                self.migrator.cancel(move_id)
        log.warning("the drain of %s is cancelled", node)
        return True

    def cancel(self, move_id: str) -> dict[str, Any]:
        """Roll a running move back (``Migrator.cancel``); the move as it stands."""
        state = self.migrator.cancel(move_id)
        return record(state, self.state.catalog.group_tables(state.plan.group))

    def pause_balancer(self, paused: bool) -> bool:
        """Start no balancing move while ``paused`` (moves running go on; a suspect node is
        still evacuated: that protects the data); returns whether it was paused before."""
        before = self.balancer_paused.is_set()
        if paused:
            self.balancer_paused.set()
        else:
            self.balancer_paused.clear()
        log.warning("the balancer is %s", "paused" if paused else "running again")
        return before

    def may_balance(self, hour: int) -> bool:
        """Whether the balancer may start moves by itself now (``hour``: UTC): on, not
        paused, within ``balance_hours``. (A suspect node is evacuated either way.)"""
        return (
            self.settings.auto_balance
            and not self.balancer_paused.is_set()
            and self.settings.balances_at(hour)
        )

    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        """Decide now; unless ``dry_run``, carry the decision out."""
        with self._balancing:
            decision = self.decide()
            results = [] if dry_run else self.carry_out(decision)
        summary = describe(decision)
        summary["moves"] = results
        self.decisions.append({**summary, "dry_run": dry_run, "at": time.time()})
        del self.decisions[:-100]
        return summary

    def carry_out(self, decision: balancer.Decision) -> list[dict[str, Any]]:
        """Run the decision's moves, at most ``max_concurrent_moves`` at a time."""
        plans: list[MovePlan] = []
        for action in decision.actions:
            try:
                # refused at once while a table of the unit's group changes rows (a change
                # waits for the moves reserved here, which run once all are): tried again
                # at the next decision
                if isinstance(action, balancer.Split):
                    plans.append(self.state.plan_split(action.unit_id, action.reason, False))
                elif isinstance(action, balancer.Merge):
                    first, second = action.first, action.second
                    plans.append(self.state.plan_merge(first, second, action.reason, False))
                else:
                    plans.append(
                        self.state.plan_move(action.unit_id, action.to, action.reason, False)
                    )
            except (MoveRefusedError, UnknownShardError) as error:
                log.info("balancer action skipped: %s", error)
        if not plans:
            return []
        with ThreadPoolExecutor(max_workers=self.settings.max_concurrent_moves) as pool:
            return list(pool.map(self.run_move, plans))

    def _balance_loop(self) -> None:
        while not self._stop.wait(self.settings.balance_interval_s):
            try:
                with self._balancing:
                    decision = self.decide()  # keeps the load rates fresh either way
                    evacuating = any(_evacuation(a) for a in decision.actions)
                    balancing = self.may_balance(time.gmtime().tm_hour)
                    if not balancing and not evacuating:
                        continue
                    if not balancing:  # paused: only what protects the data
                        evacuations = tuple(a for a in decision.actions if _evacuation(a))
                        decision = replace(decision, actions=evacuations)
                    # act on an imbalance seen twice in a row, not on one noisy window; a
                    # suspect node is evacuated at once
                    self._unbalanced_polls = self._unbalanced_polls + 1 if decision.actions else 0
                    if decision.actions and (self._unbalanced_polls >= 2 or evacuating):
                        self.decisions.append(
                            {**describe(decision), "dry_run": False, "at": time.time()}
                        )
                        del self.decisions[:-100]
                        self.carry_out(decision)
                        self._unbalanced_polls = 0
            except Exception:  # the loop must outlive any one bad poll
                log.exception("balancing failed")

    def _least_loaded(self, nodes: list[str]) -> str:
        held = Counter(u.node for g in self.state.catalog.groups.values() for u in g.units)
        capacity = self.state.placement_capacities(nodes)
        nodes = list(capacity)
        return min(nodes, key=lambda n: (held[n] / max(capacity[n], 1e-9), n))


def _evacuation(action: balancer.Action) -> bool:
    # "evacuate suspect node ...", after "observed: " where predictive balancing marks it
    return isinstance(action, balancer.Move) and "evacuate suspect node" in action.reason


def shard_rates(
    reports: Mapping[str, LoadReport], before: Mapping[str, LoadReport]
) -> dict[ShardKey, float]:
    """Execution seconds per second of each shard between two load reports of its node."""
    rates: dict[ShardKey, float] = {}
    for node, report in reports.items():
        then = before.get(node)
        window = report.at - then.at if then else 0.0
        if then is None or window <= 0:
            continue
        for key, seconds in report.shard_seconds.items():
            earlier = then.shard_seconds.get(key, 0.0)
            rates[key] = max(0.0, seconds - earlier) / window
    return rates


def operator_shares(
    reports: Mapping[str, LoadReport], before: Mapping[str, LoadReport]
) -> dict[str, float]:
    """Each calibrated operator's share of the execution time since the last reports."""
    seconds: defaultdict[str, float] = defaultdict(float)
    for node, report in reports.items():
        then = before.get(node)
        for operator, total in report.op_seconds.items():
            earlier = then.op_seconds.get(operator, 0.0) if then else 0.0
            seconds[operator] += max(0.0, total - earlier)
    total = sum(seconds.values())
    return {op: s / total for op, s in seconds.items()} if total > 0 else {}


def describe(decision: balancer.Decision) -> dict[str, Any]:
    """A decision as plain data (what ``db.cluster.rebalance()`` returns)."""
    actions = []
    for action in decision.actions:
        if isinstance(action, balancer.Split):
            actions.append({"action": "split", "unit": action.unit_id, "reason": action.reason})
        elif isinstance(action, balancer.Merge):
            actions.append(
                {"action": "merge", "units": [action.first, action.second], "reason": action.reason}
            )
        else:
            actions.append(
                {
                    "action": "move",
                    "unit": action.unit_id,
                    "to": action.to,
                    "bytes": action.bytes,
                    "reason": action.reason,
                }
            )
    return {
        "actions": actions,
        "reason": decision.reason,
        "measure": decision.measure,
        "spread": decision.spread,
        "total_load": decision.total_load,
        "projected": decision.projected,
    }
