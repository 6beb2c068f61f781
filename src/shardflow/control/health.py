"""Node health: each node's failure rate over a sliding window, and what follows from it.
A node failing more than ``threshold`` of its operations becomes *suspect* (it gets no new
shards and its shards move off live); one that stays clean for a cool-down is re-admitted
(each failure starts the cool-down again, so a node that keeps failing stays suspect and
empty); one suspected again and again is *failing* (kept empty and reported until it is
removed). Pure: samples in, transitions out.

>>> tracker = HealthTracker(HealthSettings(threshold=0.01, min_operations=100))
>>> tracker.record("node-1", at=0.0, operations=200, failures=10)
>>> [(t.node, t.after.value) for t in tracker.evaluate(now=1.0)]
[('node-1', 'suspect')]
>>> tracker.evaluate(now=2.0)  # nothing new
[]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum


class Health(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    FAILING = "failing"


TRANSITIONS = {
    # failure rate above the threshold over enough operations: stop giving it work
    (Health.HEALTHY, Health.SUSPECT),
    # no failure for a whole cool-down: it gets shards again
    (Health.SUSPECT, Health.HEALTHY),
    # suspected once too often: it stays empty until someone removes it
    (Health.HEALTHY, Health.FAILING),
}
"""Every change of a node's health the tracker makes (a failing node only leaves)."""


@dataclass(frozen=True)
class HealthSettings:
    """The thresholds (``Settings.node_failure_*``, ``suspect_cooldown_s``)."""

    threshold: float = 0.01
    """A node failing more than this share of its operations is suspect (0: never)."""
    min_operations: int = 100
    """Operations in the window before a rate counts (one failure of an idle node is not
    a rate)."""
    min_failures: int = 3
    """Failures in the window before a rate counts (a single bad query is not a rate)."""
    window_s: float = 60.0
    cooldown_s: float = 120.0
    max_suspicions: int = 3
    """The third time a node becomes suspect it is failing instead."""


@dataclass(frozen=True)
class Sample:
    at: float
    operations: int
    failures: int


@dataclass(frozen=True)
class Transition:
    node: str
    before: Health
    after: Health
    reason: str
    at: float


@dataclass
class _Node:
    health: Health = Health.HEALTHY
    since: float = 0.0
    samples: deque[Sample] = field(default_factory=deque)
    last_failure: float | None = None
    suspicions: int = 0


class HealthTracker:
    def __init__(self, settings: HealthSettings) -> None:
        self.settings = settings
        self._nodes: dict[str, _Node] = {}

    def record(self, node: str, at: float, operations: int, failures: int) -> None:
        """Operations a node did since the last record, and how many of them failed (a
        failed fragment or insert, a missed health check, a device error)."""
        if operations <= 0 and failures <= 0:
            return
        state = self._nodes.setdefault(node, _Node(since=at))
        state.samples.append(Sample(at, max(operations, failures), failures))
        if failures:
            state.last_failure = at

    def forget(self, node: str) -> None:
        """The node left the cluster."""
        self._nodes.pop(node, None)

    def rate(self, node: str, now: float) -> tuple[float, int, int]:
        """``(failure rate, operations, failures)`` over the window ending ``now``."""
        state = self._nodes.get(node)
        if state is None:
            return 0.0, 0, 0
        while state.samples and state.samples[0].at < now - self.settings.window_s:
            state.samples.popleft()
        operations = sum(s.operations for s in state.samples)
        failures = sum(s.failures for s in state.samples)
        return (failures / operations if operations else 0.0), operations, failures

    def health(self, node: str) -> Health:
        state = self._nodes.get(node)
        return Health.HEALTHY if state is None else state.health

    def excluded(self) -> frozenset[str]:
        """Nodes that get no shards now (suspect or failing)."""
        return frozenset(n for n, s in self._nodes.items() if s.health != Health.HEALTHY)

    def evaluate(self, now: float) -> list[Transition]:
        """The changes of health due at ``now``."""
        changes = []
        for node in sorted(self._nodes):
            change = self._evaluate(node, self._nodes[node], now)
            if change is not None:
                assert (change.before, change.after) in TRANSITIONS
                state = self._nodes[node]
                state.health, state.since = change.after, now
                if change.after == Health.HEALTHY:
                    # re-admitted after a clean cool-down: judged on what it does from now
                    # on, not again on the failures that made it suspect (they may still
                    # be in a window longer than the cool-down)
                    state.samples.clear()
                changes.append(change)
        return changes

    def _evaluate(self, node: str, state: _Node, now: float) -> Transition | None:
        s = self.settings
        if s.threshold <= 0:
            return None
        rate, operations, failures = self.rate(node, now)
        failing_now = (
            rate > s.threshold and operations >= s.min_operations and failures >= s.min_failures
        )
        measured = f"{failures} of {operations} operations failed ({rate:.1%}) in {s.window_s:g}s"

        def to(after: Health, why: str) -> Transition:
            return Transition(node, state.health, after, why, now)

        if state.health == Health.HEALTHY and failing_now:
            state.suspicions += 1
            if state.suspicions >= s.max_suspicions:
                return to(Health.FAILING, f"{measured}; suspect {state.suspicions} times")
            return to(Health.SUSPECT, f"{measured} > {s.threshold:.1%}")
        if state.health == Health.SUSPECT:
            clean_since = max(state.since, state.last_failure or state.since)
            if now - clean_since >= s.cooldown_s:
                return to(Health.HEALTHY, f"no failure for {now - clean_since:.0f}s")
        return None
