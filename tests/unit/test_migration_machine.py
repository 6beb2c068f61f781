"""The live-move state machine, driven with plain events."""

from __future__ import annotations

import json

import pytest

from shardflow.control import migration as m

PLAN = m.MovePlan("mv1", "move", "g1", (m.UnitSpan(3, 0, 64, "a"),), (m.UnitSpan(9, 0, 64, "b"),))
SENT = (m.SourceChecksums("a", {"t": m.Checksum(106, 4242)}, {"t": 106}),)
STORED = {"t": m.Checksum(106, 4242)}


def fenced(rows: int = 1) -> m.Fenced:
    """The sources fenced, the target applied their last ``rows``: both sides agree."""
    return m.Fenced(rows, SENT, STORED)


def drive(events: list[m.Event], policy: m.MigrationPolicy | None = None):  # type: ignore[no-untyped-def]
    state, actions = m.start(PLAN, now=0.0)
    seen = [actions]
    for t, event in enumerate(events, start=1):
        state, actions = m.step(state, event, now=float(t), policy=policy)
        seen.append(actions)
    return state, seen


def test_happy_path_visits_every_phase_in_order() -> None:
    state, actions = drive(
        [
            m.PrecheckDone(True),
            m.Copied(100, 1000),
            m.CaughtUp(5),
            fenced(1),
            m.Verified(True),
            m.Switched(),
            m.CleanedUp(),
        ]
    )
    kinds = [type(a[0]).__name__ if a else None for a in actions]
    assert kinds == [
        "RunPrecheck",
        "CopySnapshot",
        "CatchUp",
        "FenceWrites",
        "VerifyCopy",
        "SwitchRouting",
        "CleanUpSource",
        None,
    ]
    assert actions[4] == [m.VerifyCopy(SENT, STORED)]  # the fence's checksums, both sides
    assert state.phase == m.Phase.DONE and state.outcome == "done"
    assert state.copied_rows == 106
    assert state.handed_out == SENT and state.stored == STORED
    assert state.fence_seconds == pytest.approx(3.0)  # fence asked at t=3, switched at t=6
    assert set(state.phase_seconds) >= {
        "precheck",
        "copy",
        "catch_up",
        "fence",
        "verify",
        "switch",
        "cleanup",
    }


def test_the_fence_pause_is_the_sources_hold_where_they_said_it() -> None:
    """The sources measure how long they held writers (their fence to their retirement);
    the coordinator's own span is longer by a call and an answer, and stands in only where
    no source said (a switch finished after a coordinator restart)."""
    steps: list[m.Event] = [m.PrecheckDone(True), m.Copied(100, 1000), m.CaughtUp(5), fenced(1)]
    said, _ = drive([*steps, m.Verified(True), m.Switched(0.012), m.CleanedUp()])
    assert said.fence_seconds == pytest.approx(0.012)
    unsaid, _ = drive([*steps, m.Verified(True), m.Switched(None), m.CleanedUp()])
    assert unsaid.fence_seconds == pytest.approx(3.0)


def test_catch_up_repeats_until_the_delta_is_small() -> None:
    policy = m.MigrationPolicy(small_delta_rows=10, max_catch_up_rounds=5)
    state, actions = drive(
        [m.PrecheckDone(True), m.Copied(100, 1000), m.CaughtUp(500), m.CaughtUp(50), m.CaughtUp(8)],
        policy,
    )
    assert state.phase == m.Phase.FENCE and state.catch_up_rounds == 3
    assert actions[-1] == [m.FenceWrites()]


def test_catch_up_gives_up_chasing_after_the_round_limit() -> None:
    policy = m.MigrationPolicy(small_delta_rows=10, max_catch_up_rounds=2)
    state, _ = drive(
        [m.PrecheckDone(True), m.Copied(1, 1), m.CaughtUp(999), m.CaughtUp(999)], policy
    )
    assert state.phase == m.Phase.FENCE


@pytest.mark.parametrize("fail_after", range(1, 5))
def test_any_failure_before_the_switch_rolls_back(fail_after: int) -> None:
    events: list[m.Event] = [
        m.PrecheckDone(True),
        m.Copied(1, 1),
        m.CaughtUp(0),
        fenced(0),
    ][:fail_after]
    state, actions = drive([*events, m.Failed("target died")])
    assert state.phase == m.Phase.ROLLED_BACK
    assert state.outcome == "rolled back: target died"
    assert actions[-1] == [m.RollBack("target died")]


def test_failed_precheck_and_bad_verification_roll_back() -> None:
    state, _ = drive([m.PrecheckDone(False, "no memory")])
    assert state.phase == m.Phase.ROLLED_BACK and "no memory" in state.outcome
    state, _actions = drive(
        [
            m.PrecheckDone(True),
            m.Copied(1, 1),
            m.CaughtUp(0),
            fenced(0),
            m.Verified(False, "1 row missing"),
        ]
    )
    assert state.phase == m.Phase.ROLLED_BACK and "1 row missing" in state.outcome


def test_after_the_switch_nothing_is_undone() -> None:
    base = [
        m.PrecheckDone(True),
        m.Copied(1, 1),
        m.CaughtUp(0),
        fenced(0),
        m.Verified(True),
    ]
    state, actions = drive([*base, m.Failed("coordinator hiccup")])
    assert state.phase == m.Phase.SWITCH and actions[-1] == [m.SwitchRouting()]
    state, actions = drive([*base, m.Switched(), m.Failed("source gone")])
    assert state.phase == m.Phase.DONE and "cleanup deferred" in state.outcome


def test_unexpected_event_fails_the_move() -> None:
    state, _ = drive([m.Switched()])
    assert state.phase == m.Phase.ROLLED_BACK and "unexpected" in state.outcome


def test_timeouts_and_resume_after_a_coordinator_restart() -> None:
    state, _ = drive([m.PrecheckDone(True)])
    same, actions = m.tick(state, now=10.0, policy=m.MigrationPolicy(phase_timeout_s=100))
    assert same is state and actions == []
    late, actions = m.tick(state, now=1000.0, policy=m.MigrationPolicy(phase_timeout_s=100))
    assert late.phase == m.Phase.ROLLED_BACK and "timed out" in late.outcome
    rolled, actions = m.resume(state, switched=False, now=5.0)
    assert rolled.phase == m.Phase.ROLLED_BACK and isinstance(actions[0], m.RollBack)
    finished, actions = m.resume(state, switched=True, now=5.0)
    # the switch may have been cut short: the sources are retired and told first
    assert finished.phase == m.Phase.CLEANUP and actions == [m.CleanUpSource(hand_over=True)]


def test_state_survives_json() -> None:
    state, _ = drive([m.PrecheckDone(True), m.Copied(10, 20)])
    assert m.from_json(m.to_json(state)) == state
    verified, _ = drive([m.PrecheckDone(True), m.Copied(10, 20), m.CaughtUp(0), fenced(96)])
    assert verified.phase == m.Phase.VERIFY
    assert m.from_json(json.loads(json.dumps(m.to_json(verified)))) == verified


def test_verification_compares_what_was_handed_out_with_what_is_stored() -> None:
    two = (
        m.SourceChecksums("a", {"t": m.Checksum(3, 30), "u": m.Checksum(1, 5)}, {"t": 3, "u": 1}),
        m.SourceChecksums("b", {"t": m.Checksum(2, 12)}, {"t": 2}),
    )
    assert m.verify_copy(two, {"t": m.Checksum(5, 42), "u": m.Checksum(1, 5)}).ok
    missing = m.verify_copy(two, {"t": m.Checksum(4, 40), "u": m.Checksum(1, 5)})
    assert not missing.ok and "handed out 5 rows, the target stores 4" in missing.detail
    changed = m.verify_copy(two, {"t": m.Checksum(5, 43), "u": m.Checksum(1, 5)})
    assert not changed.ok and "checksums differ" in changed.detail
    absent = m.verify_copy(two, {"t": m.Checksum(5, 42)})
    assert not absent.ok and absent.detail.startswith("u:")
    escaped = (m.SourceChecksums("a", {"t": m.Checksum(3, 30)}, {"t": 4}),)
    lost_write = m.verify_copy(escaped, {"t": m.Checksum(3, 30)})
    assert (
        not lost_write.ok and "holds 4 rows under the fence but handed out 3" in lost_write.detail
    )
    assert m.verify_copy((), {"t": m.Checksum()}).ok  # empty on both sides


def test_plans_must_cover_the_same_buckets() -> None:
    with pytest.raises(ValueError, match="cover"):
        m.MovePlan(
            "x",
            "split",
            "g",
            (m.UnitSpan(1, 0, 64, "a"),),
            (m.UnitSpan(2, 0, 30, "a"), m.UnitSpan(3, 30, 60, "a")),
        )
    with pytest.raises(ValueError, match="adjacent"):
        m.MovePlan(
            "x",
            "merge",
            "g",
            (m.UnitSpan(1, 0, 10, "a"), m.UnitSpan(2, 20, 30, "a")),
            (m.UnitSpan(3, 0, 30, "a"),),
        )
