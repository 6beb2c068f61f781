"""Admission control of move copies (``control/admission.py``), with plain numbers: the
copy's AIMD rate and the foreground's slowdown it follows."""

from __future__ import annotations

import math

import pytest

from shardflow.control import admission
from shardflow.control.admission import CopyPacer, Foreground, MoveBudget

MB = 1e6


def test_an_idle_node_copies_unpaced() -> None:
    pacer = CopyPacer.capped(0)
    assert all(pacer.after_chunk(20 * MB, 0.05, 1.0) == 0.0 for _ in range(50))
    assert pacer.waited == 0.0 and pacer.rate == math.inf


def test_a_slower_foreground_halves_the_rate_down_to_the_floor() -> None:
    pacer = CopyPacer.capped(0)
    # 20 MB stored in 0.1 s (200 MB/s) while the foreground ran 1.5x slower: half of that
    assert pacer.after_chunk(20 * MB, 0.1, 1.5) == pytest.approx(0.1)
    assert pacer.rate == pytest.approx(100 * MB)
    for _ in range(10):
        pacer.after_chunk(20 * MB, 0.1, 1.5)
    assert pacer.rate == admission.FLOOR_BYTES_S  # never below: the move still progresses
    assert pacer.after_chunk(20 * MB, 0.1, 3.0) == pytest.approx(20 * MB / pacer.floor - 0.1)


def test_the_rate_grows_back_step_by_step_once_the_foreground_recovers() -> None:
    pacer = CopyPacer.capped(0)
    for _ in range(10):
        pacer.after_chunk(20 * MB, 0.1, 2.0)
    slow = pacer.rate
    pacer.after_chunk(20 * MB, 0.1, admission.SLOWDOWN_LIMIT)  # within the limit: as usual
    assert pacer.rate == pytest.approx(slow + admission.INCREASE_BYTES_S)
    for _ in range(20):
        pacer.after_chunk(20 * MB, 0.1, 1.0)
    assert pacer.rate == pytest.approx(slow + 21 * admission.INCREASE_BYTES_S)


def test_the_bandwidth_cap_bounds_the_rate_and_the_floor() -> None:
    pacer = CopyPacer.capped(8 * MB)
    assert pacer.floor == 8 * MB and pacer.rate == 8 * MB
    assert pacer.after_chunk(4 * MB, 0.1, 1.0) == pytest.approx(0.4)
    assert pacer.after_chunk(4 * MB, 0.1, 5.0) == pytest.approx(0.4)  # the cap is the floor
    assert pacer.waited == pytest.approx(0.8)


def test_the_foreground_compares_work_with_its_usual_latency() -> None:
    fg = Foreground()
    assert fg.slowdown(0.0) == 1.0  # nothing to compare
    fg.record("q1", 0.10, now=0.0, background=False)  # learns what is usual
    fg.record("q2", 0.02, now=0.1, background=False)
    assert fg.slowdown(0.2) == 1.0  # first sightings are not compared
    fg.record("q1", 0.10, now=0.3, background=False)
    assert fg.slowdown(0.3) == pytest.approx(1.0)
    # a copy runs: work takes twice as long, and the usual latency does not follow it
    for step in range(10):
        fg.record("q1", 0.20, now=1.0 + step * 0.1, background=True)
        fg.record("q2", 0.04, now=1.0 + step * 0.1, background=True)
    assert fg.usual["q1"] == pytest.approx(0.10) and fg.usual["q2"] == pytest.approx(0.02)
    assert fg.slowdown(2.0) == pytest.approx(2.0)
    # without a copy the usual latency learns; old work leaves the window
    fg.record("q1", 0.20, now=2.0, background=False)
    assert fg.usual["q1"] == pytest.approx(0.10 + admission.LEARNING * 0.10)
    assert fg.slowdown(2.0 + admission.WINDOW_S + 0.01) == 1.0


def test_the_foreground_keeps_a_bounded_number_of_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "KINDS", 3)
    fg = Foreground()
    for number in range(10):
        fg.record(f"q{number}", 0.01, now=0.0, background=False)
    assert list(fg.usual) == ["q7", "q8", "q9"]


# -- the moves' share of a busy cluster's time (MoveBudget) ---------------------------------
def test_moves_on_a_cluster_nobody_uses_go_back_to_back() -> None:
    budget = MoveBudget(0.1)
    budget.moved(0.3, now=100.0)
    assert budget.wait_before(100.0) == 0.0  # no query or insert ever finished
    budget.foreground(90.0)  # long ago
    assert budget.wait_before(100.0) == 0.0


def test_while_queries_run_a_move_waits_until_the_one_before_fits_the_share() -> None:
    budget = MoveBudget(0.1)
    budget.foreground(99.5)
    budget.moved(0.3, now=100.0)  # 0.3 s of moving leaves 2.7 s to the foreground
    assert budget.wait_before(100.0) == pytest.approx(2.7)
    budget.foreground(101.0)
    assert budget.wait_before(101.0) == pytest.approx(1.7)
    assert budget.wait_before(102.7) == 0.0
    # the foreground goes quiet: the move need not wait any more
    assert budget.wait_before(101.0 + admission.FOREGROUND_WINDOW_S + 0.1) == 0.0


def test_only_the_latest_move_counts_and_a_share_of_one_never_waits() -> None:
    budget = MoveBudget(0.5)
    for end in (10.0, 10.1, 10.2, 10.3):  # moves made while nobody queried
        budget.moved(0.1, now=end)
    budget.foreground(10.3)
    assert budget.wait_before(10.3) == pytest.approx(0.1)  # not 0.4: no debt piles up
    off = MoveBudget(1.0)
    off.foreground(10.0)
    off.moved(5.0, now=10.0)
    assert off.wait_before(10.0) == 0.0
