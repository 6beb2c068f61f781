"""Admission control for the copies of live moves: a move takes what the foreground leaves.

Each node keeps how long its queries' fragments and its inserts usually take (per kind of
work) and how much longer they take now (:class:`Foreground`); the target of a move paces
its copy by that slowdown (:class:`CopyPacer`), AIMD as TCP does: when the foreground runs
more than :data:`SLOWDOWN_LIMIT` slower than usual, the copy's rate is halved (from what it
achieved), never below a floor, so a move always progresses; otherwise it grows by a fixed
step per chunk, without bound on an idle node, up to ``migration_bandwidth_mb_s`` where that
is set. A paced chunk waits after it is stored until its bytes fit the rate."""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

SLOWDOWN_LIMIT = 1.10
"""How much slower than usual the foreground may run before copies slow down."""
DECREASE = 0.5
"""What a slowed-down foreground leaves of the copy's rate."""
INCREASE_BYTES_S = 16e6
"""What the rate grows by per chunk while the foreground runs as usual."""
FLOOR_BYTES_S = 16e6
"""The least a copy gets: a GB moves in about a minute however busy the node (or at the
bandwidth cap, where that is lower)."""
WINDOW_S = 2.0
"""How far back the foreground's latencies count."""
LEARNING = 0.1
"""Weight of a new latency in a kind of work's usual latency (an exponential average)."""
KINDS = 1024
"""Kinds of work whose usual latency is kept (the least recently seen are forgotten)."""


@dataclass
class CopyPacer:
    """The copy rate of one move: ``after_chunk`` says how long to wait after each chunk."""

    cap: float = math.inf
    """Bytes per second at most (``migration_bandwidth_mb_s``)."""
    floor: float = FLOOR_BYTES_S
    rate: float = math.inf
    waited: float = 0.0
    """Seconds waited so far."""

    def __post_init__(self) -> None:
        self.floor = min(self.floor, self.cap)
        self.rate = min(self.rate, self.cap)

    @classmethod
    def capped(cls, bandwidth_bytes_s: float) -> CopyPacer:
        return cls(cap=bandwidth_bytes_s if bandwidth_bytes_s > 0 else math.inf)

    def after_chunk(self, nbytes: int, seconds: float, slowdown: float) -> float:
        """A chunk of ``nbytes`` took ``seconds`` to fetch and store, while the foreground
        ran ``slowdown`` times slower than usual: the seconds to wait before the next."""
        if slowdown > SLOWDOWN_LIMIT:
            achieved = nbytes / seconds if seconds > 0 else math.inf
            self.rate = max(self.floor, min(self.rate, achieved) * DECREASE)
        else:
            self.rate = min(self.cap, self.rate + INCREASE_BYTES_S)
        wait = max(0.0, nbytes / self.rate - seconds)
        self.waited += wait
        return wait


@dataclass
class Foreground:
    """How much slower a node's own work (fragments, inserts) runs now than usual.

    Every finished piece of work is recorded under its kind (a fragment's SQL with its
    constants left out, an insert into a table); its usual latency is learned only while the
    node takes part in no move (``background`` false: it neither copies one nor hands one
    out), so a slowdown a move causes is seen as one for as long as it lasts.
    :meth:`slowdown` is the median, over the last :data:`WINDOW_S`, of each piece's latency
    over its kind's usual one (1.0: as usual, or nothing to compare)."""

    usual: OrderedDict[str, float] = field(default_factory=OrderedDict)
    recent: deque[tuple[float, float]] = field(default_factory=deque)
    """(when, latency over usual) of recent work."""

    def record(self, kind: str, seconds: float, now: float, background: bool) -> None:
        usual = self.usual.get(kind)
        if usual is not None and usual > 0:
            self.recent.append((now, seconds / usual))
            self.usual.move_to_end(kind)
        if usual is None:
            self.usual[kind] = seconds
            while len(self.usual) > KINDS:
                self.usual.popitem(last=False)
        elif not background:
            self.usual[kind] = usual + LEARNING * (seconds - usual)
        self._forget(now)

    def slowdown(self, now: float) -> float:
        self._forget(now)
        if not self.recent:
            return 1.0
        return statistics.median(ratio for _, ratio in self.recent)

    def _forget(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()


FOREGROUND_WINDOW_S = 2.0
"""How recently a query or insert must have finished for the foreground to count as busy
(the sessions report theirs every quarter second)."""


@dataclass
class MoveBudget:
    """How much of the time moves may take while the foreground works: ``share``.

    A plain move costs little per byte now (it opens the unit's files), and what it still
    costs is fixed: calls, a catalog change, the fence. Back to back, moves took a third of
    a busy 2-core machine and slowed its queries 1.3-1.5x. So, while queries or inserts
    run, a move waits until the moves before it fit the share: after one that took ``s``
    seconds the next starts ``s * (1 - share) / share`` seconds after it ended at the
    earliest (at ``share`` 0.1, 0.3 s of moving leaves 2.7 s to the foreground). On a
    cluster nobody uses, moves go back to back; ``share`` 1.0 never waits."""

    share: float = 1.0
    free_at: float = -math.inf
    """When the moves so far fit the share (monotonic seconds)."""
    foreground_at: float = -math.inf
    """When a query or insert last finished."""
    waited: float = 0.0
    """Seconds moves waited so far."""

    def foreground(self, now: float) -> None:
        """Queries or inserts finished (reported) at ``now``."""
        self.foreground_at = max(self.foreground_at, now)

    def busy(self, now: float) -> bool:
        return now - self.foreground_at <= FOREGROUND_WINDOW_S

    def wait_before(self, now: float) -> float:
        """Seconds the next move waits before it starts (0 on an idle cluster)."""
        if self.share >= 1.0 or not self.busy(now):
            return 0.0
        return max(0.0, self.free_at - now)

    def moved(self, seconds: float, now: float) -> None:
        """A move that took ``seconds`` ended at ``now``. Only the latest one counts: moves
        made while nobody queried leave no debt behind."""
        if self.share < 1.0:
            self.free_at = now + seconds * (1.0 - self.share) / self.share
