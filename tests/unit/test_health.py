"""Node health policy with plain data: when a node becomes suspect, is re-admitted, or is
given up as failing."""

from __future__ import annotations

import doctest

from shardflow.control import health
from shardflow.control.health import Health, HealthSettings, HealthTracker

SETTINGS = HealthSettings(threshold=0.01, min_operations=100, min_failures=3, window_s=10.0,
                          cooldown_s=30.0, max_suspicions=3)  # fmt: skip


def steady(tracker: HealthTracker, node: str, start: float, seconds: int, ops: int,
           failing_every: int) -> None:  # fmt: skip
    """``ops`` operations a second, one in ``failing_every`` failing (0: none)."""
    done = 0
    for second in range(seconds):
        failures = 0
        for _ in range(ops):
            done += 1
            failures += bool(failing_every) and done % failing_every == 0
        tracker.record(node, start + second, ops, failures)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(health).failed == 0


def test_five_percent_makes_a_node_suspect_and_a_tenth_of_a_percent_does_not() -> None:
    tracker = HealthTracker(SETTINGS)
    steady(tracker, "flaky", 0, 5, 40, failing_every=20)  # 5 %
    steady(tracker, "fine", 0, 5, 40, failing_every=1000)  # 0.1 %
    changes = tracker.evaluate(5.0)
    assert [(c.node, c.before, c.after) for c in changes] == [
        ("flaky", Health.HEALTHY, Health.SUSPECT)
    ]
    assert "5.0%" in changes[0].reason and tracker.excluded() == {"flaky"}
    steady(tracker, "fine", 5, 60, 40, failing_every=1000)
    assert all(c.node != "fine" for c in tracker.evaluate(65.0))
    assert tracker.health("fine") == Health.HEALTHY


def test_an_idle_node_with_one_failure_is_not_suspect() -> None:
    tracker = HealthTracker(SETTINGS)
    tracker.record("idle", 0, 3, 1)  # 33 %, but three operations
    tracker.record("busy-once", 0, 500, 2)  # two bad queries are not a rate
    tracker.record("busy-once", 1, 0, 0)
    assert tracker.evaluate(1.0) == []


def test_failures_leave_the_window() -> None:
    tracker = HealthTracker(SETTINGS)
    tracker.record("n", 0, 100, 10)
    assert tracker.rate("n", 5.0) == (0.1, 100, 10)
    assert tracker.rate("n", 11.0) == (0.0, 0, 0)


def test_a_clean_cooldown_readmits_and_each_failure_restarts_it() -> None:
    tracker = HealthTracker(SETTINGS)
    steady(tracker, "a", 0, 5, 40, failing_every=20)
    steady(tracker, "b", 0, 5, 40, failing_every=20)
    tracker.evaluate(5.0)
    assert tracker.excluded() == {"a", "b"}
    # evacuated: "a" only answers health checks, "b" keeps failing some of them
    for second in range(5, 40):
        tracker.record("a", second, 1, 0)
        tracker.record("b", second, 1, int(second % 4 == 0))
    changes = {c.node: c for c in tracker.evaluate(40.0)}
    assert changes["a"].after == Health.HEALTHY and "no failure" in changes["a"].reason
    assert "b" not in changes and tracker.excluded() == {"b"}  # still failing: still empty
    for second in range(40, 60):
        tracker.record("b", second, 1, 0)
    assert tracker.evaluate(60.0) == []  # clean for 24 s of the 30
    changes = {c.node: c for c in tracker.evaluate(66.0)}
    assert changes["b"].after == Health.HEALTHY


def test_a_node_suspected_again_and_again_is_failing() -> None:
    tracker = HealthTracker(SETTINGS)
    start = 0.0
    afters = []
    for _ in range(3):
        steady(tracker, "flappy", int(start), 5, 40, failing_every=20)
        afters += [c.after for c in tracker.evaluate(start + 5)]
        start += 50.0  # clean for longer than the cool-down
        tracker.record("flappy", start - 1, 1, 0)
        afters += [c.after for c in tracker.evaluate(start)]
    assert afters[:4] == [Health.SUSPECT, Health.HEALTHY, Health.SUSPECT, Health.HEALTHY]
    assert afters[4] == Health.FAILING


def test_a_zero_threshold_turns_it_off() -> None:
    tracker = HealthTracker(HealthSettings(threshold=0.0))
    tracker.record("n", 0, 1000, 1000)
    assert tracker.evaluate(1.0) == [] and tracker.excluded() == frozenset()


def test_a_readmitted_node_is_not_suspected_again_for_failures_before_its_cooldown() -> None:
    """A window longer than the cool-down still holds the failures that made the node
    suspect when it is re-admitted; they must not count again (with no new failure it
    stays healthy, instead of going suspect, suspect, failing)."""
    settings = HealthSettings(threshold=0.01, min_operations=50, min_failures=3, window_s=10.0,
                              cooldown_s=4.0, max_suspicions=3)  # fmt: skip
    tracker = HealthTracker(settings)
    steady(tracker, "n", 0, 3, 40, failing_every=20)  # 5 % for 3 s: suspect
    assert tracker.evaluate(3.0)[0].after == Health.SUSPECT
    steady(tracker, "n", 3, 5, 1, failing_every=0)  # evacuated: health checks only, all fine
    assert [c.after for c in tracker.evaluate(7.5)] == [Health.HEALTHY]
    for second in range(8, 20):  # within the old window and after: still nothing fails
        tracker.record("n", second, 1, 0)
        assert tracker.evaluate(second + 0.5) == [], second
    assert tracker.health("n") == Health.HEALTHY
