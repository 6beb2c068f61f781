"""A seeded chaos run of live moves, without Ray: forced moves, splits and merges, each maybe
hit by a fault — its source or target killed mid-copy or at the fence (the node is failed
over and a new node joins in its place, as a dead worker stays dead), the coordinator
restarted between two steps of the move, a slow node — while inserts land between the
steps (so catch-up and fence carry rows).

After every move: it is done or rolled back, nothing is left half-way, and the cluster
serves exactly the rows acknowledged so far (DuckDB over the same rows is the oracle). At the
end: at least 99 % of the moves no fault hit are done, the Prometheus counter has every
outcome, and no worker keeps an export, an import or a compaction hold of a finished move.

``SHARDFLOW_CHAOS_MOVES`` sets the number of moves (48 in ``make test``; 240 for the long
run) and ``SHARDFLOW_CHAOS_SEED`` the seed."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from shardflow.control.migration import MovePlan
from shardflow.errors import MoveRefusedError
from shardflow.runtime.inprocess import LocalSourceLink, LocalWorker, LocalWorkers
from tests.support.local_cluster import LocalCluster, assert_serves, events, orders

MOVES = int(os.environ.get("SHARDFLOW_CHAOS_MOVES", "48"))
SEED = int(os.environ.get("SHARDFLOW_CHAOS_SEED", "20261204"))
ROWS = 6_000
BATCH = 40

FAULTS = (
    None,
    "slow_node",
    "source_killed_mid_copy",
    None,
    "target_killed_mid_copy",
    "coordinator_restarted",
    None,
    "source_killed_at_fence",
    "slow_node",
    "target_killed_at_fence",
    None,
    "coordinator_restarted",
)
"""Every kind of fault comes round in turn (the moves, their units and nodes are random):
a short run meets each of them, and a coordinator restart before each step in turn."""
CRASH_AT = (
    "before copy_snapshot",
    "before catch_up",
    "before finish_import",
    "before fence",  # the target asked the source (worker to worker): the restart comes then
    "after finish_import",  # the target serves the copy already; the switch has not come
    "before retire",  # after the switch
)
"""Where a coordinator restart may come: just before, or just after, a call to a worker
(the fence: as the move's target calls its source)."""


class CoordinatorCrash(BaseException):
    """The coordinator process is gone (not an error anything in it may catch)."""


@dataclass
class Fault:
    kind: str
    crash_at: str = ""
    node: str = ""
    fired: bool = False


class ChaosWorker:
    """A worker as the migrator calls it: faults fire before the calls they name."""

    def __init__(self, chaos: Chaos, inner: LocalWorker) -> None:
        self._chaos = chaos
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self._chaos.before(self._inner.node_id, name)
            answer = target(*args, **kwargs)
            self._chaos.crash_at(f"after {name}")
            return answer

        return call


class ChaosWorkers:
    def __init__(self, chaos: Chaos, inner: LocalWorkers) -> None:
        self._chaos = chaos
        self._inner = inner

    def get(self, node: str) -> ChaosWorker:
        return ChaosWorker(self._chaos, self._inner.get(node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Chaos:
    def __init__(self, cluster: LocalCluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self.fault: Fault | None = None
        self.fencing = False
        """Whether the move running fenced a source already."""
        self.plan_nodes: tuple[str, str] = ("", "")
        """(a source node, the target node) of the move running."""
        self.acknowledged = [events(0, ROWS)]
        self.next_id = ROWS
        self.new_nodes = itertools.count(len(cluster.catalog.nodes))
        self.moves = self.crashes = 0
        self.counted: Counter[str] = Counter()
        """Outcomes the coordinators' Prometheus counters had, summed over restarts."""
        self._install()

    # -- wiring -------------------------------------------------------------------------
    def _install(self) -> None:
        workers = self.cluster.workers
        self.cluster.controller.migrator.workers = ChaosWorkers(self, workers)  # type: ignore[assignment]
        original = LocalWorkers.link

        def link(node: str) -> LocalSourceLink:
            return ChaosLink(self, original(workers, node))

        workers.link = link  # type: ignore[method-assign]

    # -- load ---------------------------------------------------------------------------
    def insert(self) -> None:
        """A batch of new rows, acknowledged once ``insert`` returns."""
        batch = events(self.next_id, BATCH)
        self.next_id += BATCH
        self.cluster.insert("events", batch)
        self.acknowledged.append(batch)

    def rows(self) -> pa.Table:
        return pa.concat_tables(self.acknowledged)

    # -- faults -------------------------------------------------------------------------
    def before(self, node: str, call: str) -> None:
        if call == "catch_up" or (call == "fence" and not self.fencing):
            # rows arrive while the move runs, for catch-up and the fence to carry (not
            # once a source is fenced: the insert would wait on this very thread)
            self.insert()
        self.fencing = self.fencing or call == "fence"
        fault = self.fault
        if fault is None or fault.fired:
            if fault is not None and fault.kind == "slow_node" and node == fault.node:
                time.sleep(0.01)
            return
        source, _ = self.plan_nodes
        if fault.kind == "source_killed_at_fence" and call == "fence":
            self.kill(source)
        else:
            self.crash_at(f"before {call}")

    def fenced(self) -> None:
        """A source answered the target's fence: it holds writes now."""
        fault = self.fault
        if fault is not None and not fault.fired and fault.kind == "target_killed_at_fence":
            self.kill(self.plan_nodes[1])  # the sources are fenced; the target dies

    def crash_at(self, point: str) -> None:
        fault = self.fault
        if fault is not None and not fault.fired and fault.crash_at == point:
            fault.fired = True
            raise CoordinatorCrash(point)

    def mid_copy(self) -> None:
        """A chunk of a snapshot is on its way to the target."""
        fault = self.fault
        if fault is None or fault.fired:
            return
        source, target = self.plan_nodes
        if fault.kind == "source_killed_mid_copy":
            self.kill(source)
        elif fault.kind == "target_killed_mid_copy":
            self.kill(target)

    def kill(self, node: str) -> None:
        """The node's worker dies; the coordinator fails it over (its units are rebuilt
        from storage elsewhere) and a new node joins in its place."""
        assert self.fault is not None
        self.fault.fired = True
        cluster = self.cluster
        cluster.workers.stop(node)
        cluster.controller.fail_node(node)
        joined = f"node-{next(self.new_nodes)}"
        cluster.state.node_joined(joined)
        cluster.workers.start(joined, cluster.state.catalog_json())
        cluster.controller.broadcast()

    def restart_coordinator(self) -> list[str]:
        """A new coordinator over the same data directory and workers; it finishes or
        rolls back the move the old one left (what ``Controller.start`` does in a thread)."""
        self._count_outcomes()
        node = self.cluster.backend.restart_coordinator()
        self._install()
        return [str(result["outcome"]) for result in node.controller.resume()]

    def _count_outcomes(self) -> None:
        for sample in self.cluster.registry.collect():
            for metric in sample.samples:
                if metric.name == "shardflow_migrations_total":
                    self.counted[metric.labels["outcome"]] += int(metric.value)

    # -- one move ---------------------------------------------------------------------------
    def pick_fault(self) -> Fault | None:
        kind = FAULTS[self.moves % len(FAULTS)]
        self.moves += 1
        if kind is None:
            return None
        fault = Fault(kind)
        if kind == "coordinator_restarted":
            fault.crash_at = CRASH_AT[self.crashes % len(CRASH_AT)]
            self.crashes += 1
        if kind == "slow_node":
            fault.node = self.rng.choice(self.cluster.catalog.nodes)
        return fault

    def pick_plan(self) -> MovePlan:
        for _ in range(20):
            try:
                return self._pick_plan()
            except MoveRefusedError:  # a unit of one bucket cannot be split: pick again
                continue
        raise AssertionError("no move could be planned")

    def _pick_plan(self) -> MovePlan:
        state = self.cluster.state
        units = list(self.cluster.units("events"))
        choice = self.rng.random()
        if choice < 0.2 and len(units) < 16:
            return state.plan_split(self.rng.choice(units).unit_id)
        if choice < 0.4 and len(units) > 4:
            ordered = sorted(units, key=lambda u: u.lo)
            index = self.rng.randrange(len(ordered) - 1)
            return state.plan_merge(ordered[index].unit_id, ordered[index + 1].unit_id)
        unit = self.rng.choice(units)
        others = [n for n in self.cluster.catalog.nodes if n != unit.node]
        return state.plan_move(unit.unit_id, self.rng.choice(others))

    def run_one(self) -> tuple[Fault | None, str]:
        self.fault = self.pick_fault()
        self.fencing = False
        plan = self.pick_plan()
        self.plan_nodes = (plan.sources[0].node, plan.targets[0].node)
        try:
            outcome = str(self.cluster.controller.run_move(plan)["outcome"])
        except CoordinatorCrash:
            [outcome] = self.restart_coordinator()
        finally:
            fired, self.fault = self.fault, None
        return fired, outcome


class ChaosLink:
    """A target's link to a source: a kill may come between two chunks of the copy."""

    def __init__(self, chaos: Chaos, inner: LocalSourceLink) -> None:
        self._chaos = chaos
        self._inner = inner

    def chunks(self, move_id: str, key: Any) -> Iterator[pa.Table]:
        for chunk in self._inner.chunks(move_id, key):
            yield chunk
            self._chaos.mid_copy()

    def fence(self, move_id: str) -> Any:
        self._chaos.before(self._inner.source.node_id, "fence")
        answer = self._inner.fence(move_id)
        self._chaos.fenced()
        return answer

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self._inner, name)  # type: ignore[no-any-return]


def test_a_seeded_chaos_run_of_moves_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    # moves back to back: the churn is what it checks (pacing: test_pacing.py)
    cluster = LocalCluster(
        tmp_path / "data", nodes=4, wal_checkpoint_entries=16, migration_share=1.0
    )
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        cluster.create_table("orders_e", orders(0, ROWS), "oid", colocate_with="events")
        chaos = Chaos(cluster, rng)
        outcomes: Counter[tuple[str, str]] = Counter()
        for number in range(MOVES):
            fault, outcome = chaos.run_one()
            kind = fault.kind if fault is not None and fault.fired else "none"
            if fault is not None and fault.kind == "slow_node":
                kind = "slow_node"  # slow is not a fault: the move must succeed
            status = "done" if outcome.startswith("done") else "rolled_back"
            assert outcome.startswith(("done", "rolled back")), (number, kind, outcome)
            outcomes[(kind, status)] += 1
            # nothing half-way, and exactly the acknowledged rows, after every move
            assert not cluster.state.moving, (number, kind)
            assert_serves(cluster, chaos.rows())
            for node in cluster.catalog.nodes:  # each node serves what the catalog says
                units = {u.unit_id for u in cluster.units("events") if u.node == node}
                served = cluster.workers.get(node).node.shards
                assert {u for (_, u) in served} == units, (number, kind, node)
            chaos.insert()
        chaos._count_outcomes()

        clean = [k for k in outcomes if k[0] in {"none", "slow_node"}]
        tried = sum(outcomes[k] for k in clean)
        done = sum(outcomes[k] for k in clean if k[1] == "done")
        print(f"chaos: {MOVES} moves, seed {SEED}: {dict(sorted(outcomes.items()))}")
        assert tried and done / tried >= 0.99, dict(outcomes)
        assert sum(v for (kind, _), v in outcomes.items() if kind not in {"none", "slow_node"})
        for status in ("done", "rolled_back"):  # resumed moves are counted too
            assert chaos.counted[status] == sum(v for (_, s), v in outcomes.items() if s == status)
        # every node still running keeps nothing of a finished move
        for node in cluster.catalog.nodes:
            worker = cluster.workers.get(node).node
            assert not worker.source.exports and not worker.target.imports, node
            assert worker.engine.compactor.held == 0, node
            assert not any(s.fenced or s.exporting for s in worker.shards.values()), node
        assert_serves(cluster, chaos.rows())
    finally:
        cluster.close()
