"""Live moves of placement units — a migration, a split or a merge — as a pure state
machine: events in, actions out. The runtime carries out the actions and feeds back what
happened; every transition is persisted, so a restarted coordinator finishes or rolls back
a half-done move.

Pre-copy, like VM live migration::

    PRECHECK -> COPY -> CATCH_UP (repeat until the delta is small) -> FENCE -> VERIFY
             -> SWITCH -> CLEANUP -> DONE

At FENCE each source holds new writes and hands out, in one answer, the changes the target
has not had yet and the checksums of everything it handed out; the target applies those
changes and answers with the checksums of what it stores. ``Fenced`` carries both sides and
VERIFY compares them (:func:`verify_copy`). Any failure before SWITCH rolls back: the source
never stopped serving, the target drops its copy. After SWITCH the move is final; a failed
cleanup is retried later, never undone.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

MoveKind = Literal["move", "split", "merge"]


class Phase(StrEnum):
    PRECHECK = "precheck"
    COPY = "copy"
    CATCH_UP = "catch_up"
    FENCE = "fence"
    VERIFY = "verify"
    SWITCH = "switch"
    CLEANUP = "cleanup"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


BEFORE_SWITCH = (Phase.PRECHECK, Phase.COPY, Phase.CATCH_UP, Phase.FENCE, Phase.VERIFY)
TERMINAL = (Phase.DONE, Phase.ROLLED_BACK)


@dataclass(frozen=True)
class UnitSpan:
    """A unit as a move sees it: bucket range and owner."""

    unit_id: int
    lo: int
    hi: int
    node: str


@dataclass(frozen=True)
class MovePlan:
    """What moves where. Sources are replaced by targets, which cover the same buckets."""

    move_id: str
    kind: MoveKind
    group: str
    sources: tuple[UnitSpan, ...]
    targets: tuple[UnitSpan, ...]
    reason: str = ""

    def __post_init__(self) -> None:
        def covered(spans: tuple[UnitSpan, ...]) -> list[tuple[int, int]]:
            return sorted((s.lo, s.hi) for s in spans)

        source, target = covered(self.sources), covered(self.targets)
        if not source or not target:
            raise ValueError("a move needs sources and targets")
        for ranges in (source, target):
            for (_, hi), (lo, _) in itertools.pairwise(ranges):
                if hi != lo:
                    raise ValueError(f"units of a move must be adjacent: {ranges}")
        if (source[0][0], source[-1][1]) != (target[0][0], target[-1][1]):
            raise ValueError(f"targets {target} do not cover the sources {source}")

    @property
    def nodes(self) -> set[str]:
        return {s.node for s in self.sources} | {t.node for t in self.targets}


@dataclass(frozen=True)
class Checksum:
    """Rows and the sum of their hashes: order-independent and additive, so the parts of a
    split add up to the whole and the order rows travel in does not matter."""

    rows: int = 0
    digest: int = 0

    def __add__(self, other: Checksum) -> Checksum:
        return Checksum(self.rows + other.rows, self.digest + other.digest)


@dataclass(frozen=True)
class SourceChecksums:
    """What one source of a move handed out, as it says under the fence: per table, the
    checksum of everything it handed out (the pinned snapshot and every change since) and
    the rows it holds (equal to the rows handed out, unless a write escaped the copy)."""

    node: str
    handed_out: Mapping[str, Checksum]
    held: Mapping[str, int]


@dataclass(frozen=True)
class MigrationPolicy:
    """When catch-up stops and how long a phase may take."""

    small_delta_rows: int = 2_000
    max_catch_up_rounds: int = 10
    phase_timeout_s: float = 600.0


# -- events (what happened) --------------------------------------------------------------
@dataclass(frozen=True)
class PrecheckDone:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Copied:
    rows: int
    bytes: int


@dataclass(frozen=True)
class CaughtUp:
    rows: int


@dataclass(frozen=True)
class Fenced:
    """The sources hold writes; the target applied their last changes (``rows``)."""

    rows: int
    handed_out: tuple[SourceChecksums, ...]
    """What each fenced source handed out, with its final checksums."""
    stored: Mapping[str, Checksum]
    """Per table, what the target stores: its copy of the snapshot and every change it
    applied, the last ones included."""


@dataclass(frozen=True)
class Verified:
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Switched:
    held_s: float | None = None
    """How long the sources held writers, the longest of them, as each measured it (from
    its fence to its retirement, after the switch); None where no source said (a switch
    finished after a coordinator restart): the pause is then counted from FENCE on."""


@dataclass(frozen=True)
class CleanedUp:
    pass


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class Cancelled:
    """An operator cancelled the move: rolled back before the switch (outcome
    ``cancelled: ...``); once switched it is done already, and ends as it would."""

    reason: str


CANCELLED = "cancelled"
"""How the outcome of a cancelled move begins."""

Event = (
    PrecheckDone | Copied | CaughtUp | Fenced | Verified | Switched | CleanedUp | Failed | Cancelled
)


# -- actions (what to do next) -----------------------------------------------------------
@dataclass(frozen=True)
class RunPrecheck:
    pass


@dataclass(frozen=True)
class CopySnapshot:
    pass


@dataclass(frozen=True)
class CatchUp:
    pass


@dataclass(frozen=True)
class FenceWrites:
    pass


@dataclass(frozen=True)
class VerifyCopy:
    """Compare what the sources handed out with what the target stores."""

    handed_out: tuple[SourceChecksums, ...]
    stored: Mapping[str, Checksum]


@dataclass(frozen=True)
class SwitchRouting:
    pass


@dataclass(frozen=True)
class CleanUpSource:
    hand_over: bool = False
    """The switch was cut short (a coordinator restarted past it): retire the sources and
    tell every node the routing first, as the switch would have, before dropping them."""


@dataclass(frozen=True)
class RollBack:
    reason: str


Action = (
    RunPrecheck
    | CopySnapshot
    | CatchUp
    | FenceWrites
    | VerifyCopy
    | SwitchRouting
    | CleanUpSource
    | RollBack
)


@dataclass(frozen=True)
class MigrationState:
    plan: MovePlan
    phase: Phase
    started_at: float
    phase_started_at: float
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    catch_up_rounds: int = 0
    copied_rows: int = 0
    copied_bytes: int = 0
    delta_rows: int = 0
    fenced_at: float | None = None
    fence_seconds: float = 0.0
    """How long writers to the moving units were held: as the sources measured it, from
    their fence to their retirement after the switch (the coordinator's own span, from
    FENCE to CLEANUP, is one call to a source and one answer longer: ``phase_seconds``)."""
    finished_at: float | None = None
    outcome: str = ""
    handed_out: tuple[SourceChecksums, ...] = ()
    """The sources' checksums at the fence (empty before it)."""
    stored: Mapping[str, Checksum] = field(default_factory=dict)
    """The target's checksums after it applied the last changes (empty before the fence)."""

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL

    def _enter(self, phase: Phase, now: float, **changes: Any) -> MigrationState:
        spent = dict(self.phase_seconds)
        spent[self.phase.value] = spent.get(self.phase.value, 0.0) + (now - self.phase_started_at)
        finished = now if phase in TERMINAL else None
        return dataclasses.replace(
            self,
            phase=phase,
            phase_started_at=now,
            phase_seconds=spent,
            finished_at=finished,
            **changes,
        )


def start(plan: MovePlan, now: float) -> tuple[MigrationState, list[Action]]:
    return MigrationState(plan, Phase.PRECHECK, now, now), [RunPrecheck()]


def step(
    state: MigrationState, event: Event, now: float, policy: MigrationPolicy | None = None
) -> tuple[MigrationState, list[Action]]:
    """The next state and what to do, given what happened."""
    policy = policy or MigrationPolicy()
    if state.done:
        return state, []
    if isinstance(event, Failed):
        return _transition_failed(state, event, now)
    if isinstance(event, Cancelled):
        if state.phase in BEFORE_SWITCH:
            return _transition_failed(state, Failed(event.reason), now, CANCELLED)
        return state, []  # switched: nothing to undo, the move ends as it would
    handler = _HANDLERS.get((state.phase, type(event)))
    if handler is None:
        return _transition_failed(
            state, Failed(f"unexpected {type(event).__name__} in {state.phase}"), now
        )
    return handler(state, event, now, policy)


def tick(
    state: MigrationState, now: float, policy: MigrationPolicy | None = None
) -> tuple[MigrationState, list[Action]]:
    """Time passing: a phase before the switch that takes too long fails the move."""
    policy = policy or MigrationPolicy()
    elapsed = now - state.phase_started_at
    if state.phase in BEFORE_SWITCH and elapsed > policy.phase_timeout_s:
        return _transition_failed(state, Failed(f"{state.phase} timed out"), now)
    return state, []


def resume(
    state: MigrationState, switched: bool, now: float
) -> tuple[MigrationState, list[Action]]:
    """What a restarted coordinator does with a move it finds unfinished. ``switched`` says
    whether the routing change reached the persisted catalog."""
    if state.done:
        return state, []
    if switched:
        moved = state if state.phase == Phase.CLEANUP else state._enter(Phase.CLEANUP, now)
        return moved, [CleanUpSource(hand_over=True)]
    return _transition_failed(state, Failed("the coordinator restarted during the move"), now)


# -- transitions -------------------------------------------------------------------------
def _transition_precheck_copy(
    state: MigrationState, event: PrecheckDone, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    if not event.ok:
        return _transition_failed(state, Failed(f"precheck: {event.reason}"), now)
    return state._enter(Phase.COPY, now), [CopySnapshot()]


def _transition_copy_catch_up(
    state: MigrationState, event: Copied, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    moved = state._enter(Phase.CATCH_UP, now, copied_rows=event.rows, copied_bytes=event.bytes)
    return moved, [CatchUp()]


def _transition_catch_up_fence(
    state: MigrationState, event: CaughtUp, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    rounds = state.catch_up_rounds + 1
    small = event.rows <= policy.small_delta_rows
    if not small and rounds < policy.max_catch_up_rounds:
        again = dataclasses.replace(
            state,
            catch_up_rounds=rounds,
            delta_rows=event.rows,
            copied_rows=state.copied_rows + event.rows,
        )
        return again, [CatchUp()]
    fenced = state._enter(  # writers are held from here: the fence pause counts from now
        Phase.FENCE,
        now,
        fenced_at=now,
        catch_up_rounds=rounds,
        delta_rows=event.rows,
        copied_rows=state.copied_rows + event.rows,
    )
    return fenced, [FenceWrites()]


def _transition_fence_verify(
    state: MigrationState, event: Fenced, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    moved = state._enter(
        Phase.VERIFY,
        now,
        delta_rows=event.rows,
        copied_rows=state.copied_rows + event.rows,
        handed_out=event.handed_out,
        stored=dict(event.stored),
    )
    return moved, [VerifyCopy(event.handed_out, dict(event.stored))]


def _transition_verify_switch(
    state: MigrationState, event: Verified, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    if not event.ok:
        return _transition_failed(state, Failed(f"verification: {event.detail}"), now)
    return state._enter(Phase.SWITCH, now), [SwitchRouting()]


def _transition_switch_cleanup(
    state: MigrationState, event: Switched, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    fence = now - state.fenced_at if state.fenced_at is not None else 0.0
    if event.held_s is not None:
        fence = event.held_s
    return state._enter(Phase.CLEANUP, now, fence_seconds=fence), [CleanUpSource()]


def _transition_cleanup_done(
    state: MigrationState, event: CleanedUp, now: float, policy: MigrationPolicy
) -> tuple[MigrationState, list[Action]]:
    return state._enter(Phase.DONE, now, outcome="done"), []


def _transition_failed(
    state: MigrationState, event: Failed, now: float, how: str = "rolled back"
) -> tuple[MigrationState, list[Action]]:
    if state.phase in BEFORE_SWITCH:
        fence = now - state.fenced_at if state.fenced_at is not None else 0.0
        rolled = state._enter(
            Phase.ROLLED_BACK, now, outcome=f"{how}: {event.reason}", fence_seconds=fence
        )
        return rolled, [RollBack(event.reason)]
    if state.phase == Phase.SWITCH:  # routing may have changed: find out, never undo
        return state, [SwitchRouting()]
    return state._enter(
        Phase.DONE, now, outcome=f"done; source cleanup deferred: {event.reason}"
    ), []


Handler = Callable[
    [MigrationState, Any, float, MigrationPolicy], tuple[MigrationState, list[Action]]
]
_HANDLERS: dict[tuple[Phase, type], Handler] = {
    (Phase.PRECHECK, PrecheckDone): _transition_precheck_copy,
    (Phase.COPY, Copied): _transition_copy_catch_up,
    (Phase.CATCH_UP, CaughtUp): _transition_catch_up_fence,
    (Phase.FENCE, Fenced): _transition_fence_verify,
    (Phase.VERIFY, Verified): _transition_verify_switch,
    (Phase.SWITCH, Switched): _transition_switch_cleanup,
    (Phase.CLEANUP, CleanedUp): _transition_cleanup_done,
}


# -- verification ------------------------------------------------------------------------
def verify_copy(handed_out: Sequence[SourceChecksums], stored: Mapping[str, Checksum]) -> Verified:
    """Whether the target stores exactly what the sources handed out, table by table: the
    same rows and the same sum of row hashes. A source that holds more rows than it handed
    out lost a write on the way; a different sum with equal rows is a changed value.

    >>> sent = (SourceChecksums("node-0", {"t": Checksum(3, 30)}, {"t": 3}),)
    >>> verify_copy(sent, {"t": Checksum(3, 30)})
    Verified(ok=True, detail='')
    >>> verify_copy(sent, {"t": Checksum(2, 19)}).detail
    't: the sources handed out 3 rows, the target stores 2 (checksums differ)'
    """
    expected: dict[str, Checksum] = {}
    for source in handed_out:
        for table, sums in sorted(source.handed_out.items()):
            held = source.held[table] if table in source.held else 0
            if held != sums.rows:
                return Verified(
                    False,
                    f"{table}: {source.node} holds {held} rows under the fence but handed out"
                    f" {sums.rows}",
                )
            expected[table] = expected[table] + sums if table in expected else sums
    for table in sorted(set(expected) | set(stored)):
        want = expected[table] if table in expected else Checksum()
        have = stored[table] if table in stored else Checksum()
        if want.rows != have.rows:
            same = "equal" if want.digest == have.digest else "differ"
            return Verified(
                False,
                f"{table}: the sources handed out {want.rows} rows, the target stores"
                f" {have.rows} (checksums {same})",
            )
        if want.digest != have.digest:
            return Verified(
                False,
                f"{table}: {want.rows} rows on both sides, but their checksums differ"
                " (a value changed in the copy)",
            )
    return Verified(True)


# -- persistence -------------------------------------------------------------------------
def to_json(state: MigrationState) -> dict[str, Any]:
    data = dataclasses.asdict(state)
    data["phase"] = state.phase.value
    return data


def plan_from_json(plan: Mapping[str, Any]) -> MovePlan:
    return MovePlan(
        move_id=plan["move_id"],
        kind=plan["kind"],
        group=plan["group"],
        sources=tuple(UnitSpan(**s) for s in plan["sources"]),
        targets=tuple(UnitSpan(**t) for t in plan["targets"]),
        reason=plan.get("reason", ""),
    )


def _checksums_from_json(data: Mapping[str, Mapping[str, int]]) -> dict[str, Checksum]:
    return {table: Checksum(int(c["rows"]), int(c["digest"])) for table, c in data.items()}


def from_json(data: Mapping[str, Any]) -> MigrationState:
    nested = ("plan", "phase", "handed_out", "stored")
    fields = {k: v for k, v in data.items() if k not in nested}
    # records of moves that never reached the fence have no checksums
    handed_out = tuple(
        SourceChecksums(
            s["node"],
            _checksums_from_json(s["handed_out"]),
            {table: int(rows) for table, rows in s["held"].items()},
        )
        for s in (data["handed_out"] if "handed_out" in data else ())
    )
    stored = _checksums_from_json(data["stored"]) if "stored" in data else {}
    return MigrationState(
        plan=plan_from_json(data["plan"]),
        phase=Phase(data["phase"]),
        handed_out=handed_out,
        stored=stored,
        **fields,
    )
