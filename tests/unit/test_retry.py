"""The client's one retry loop (``runtime/client/retry.py``) with plain functions: a retry
whose fresh routing is newer than the failed attempt's goes at once, one whose routing
brought nothing new backs off."""

from __future__ import annotations

import pytest

from shardflow.errors import ClusterError, Moved
from shardflow.runtime.client import retry


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", slept.append)
    return slept


def failing(times: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise Moved("t#1", 3)
        return "done"

    return calls, attempt


def test_a_move_switched_since_the_attempt_is_retried_without_waiting(
    sleeps: list[float],
) -> None:
    version = [7]
    calls, attempt = failing(2)

    def refresh() -> None:
        version[0] += 1  # each refresh finds the routing a move switched

    assert retry.retrying("query", attempt, 30, refresh, version=lambda: version[0]) == "done"
    assert len(calls) == 3 and sleeps == []  # the 50 ms back-off would add to each query


def test_routing_that_brought_nothing_new_backs_off(sleeps: list[float]) -> None:
    refreshes: list[int] = []
    calls, attempt = failing(3)
    got = retry.retrying("query", attempt, 30, lambda: refreshes.append(1), version=lambda: 7)
    assert got == "done" and len(calls) == 4
    assert sleeps == [0.05, 0.1, 0.2]  # a node not told yet: wait, doubling
    assert len(refreshes) == 6  # once at once (nothing new), once after each wait


def test_without_a_version_every_retry_waits_as_before(sleeps: list[float]) -> None:
    calls, attempt = failing(2)
    assert retry.retrying("insert", attempt, 30, lambda: None) == "done"
    assert len(calls) == 3 and sleeps == [0.05, 0.1]


def test_the_deadline_still_ends_retries_that_never_succeed(
    sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(retry.time, "monotonic", lambda: float(next(clock)))
    _, attempt = failing(1000)
    with pytest.raises(ClusterError, match="retry_deadline_s"):
        retry.retrying("query", attempt, 25, lambda: None, version=lambda: 1)
