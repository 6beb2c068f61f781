"""The live part of ``make demo``: while two readers (answers checked against DuckDB) and an
inserter run, the cluster takes two new nodes, the balancer moves shards onto them, a shard
is migrated and one split by hand, a node is drained, a worker is killed with SIGKILL and a
slower device joins. One screen shows it as it happens (rich ``Live``: QPS, latency, a
map of nodes and their shards, moves in flight with their phase, fence pauses, failovers); with
``live=False`` the same events are printed as plain lines (CI logs). It ends with what the
clients saw: queries run, failed, wrong; rows acknowledged, lost, duplicated; moves done and
rolled back; the slowest fence; the recovery time after the kill.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from shardflow.api import Database
from shardflow.errors import Error, MoveRefusedError
from shardflow.records import MigrationRecord, NodeInfo

EVENTS = "demo_events"
"""The table the inserter writes; every acknowledged id must be there exactly once."""
BATCH = 100
LOOKUP_SQL = (
    "SELECT o_orderkey, o_custkey, o_totalprice, o_orderdate FROM orders WHERE o_orderkey = ?"
)
"""The point lookup a reader runs, one order key at a time (a parameter bound late)."""
SLOWDOWN = 4.0
"""How much slower the simulated device of the last step is."""
WINDOW_S = 3.0
"""QPS and latency on screen are over this many recent seconds."""
RECOVERY_TIMEOUT_S = 120.0
TERMINAL = ("done", "rolled_back")
COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def missing_and_extra(acked: list[int], present: list[int]) -> tuple[int, int]:
    """Acknowledged ids not in the table (lost), and ids there more often than acknowledged
    (duplicated, or never acknowledged)."""
    want, have = Counter(acked), Counter(present)
    return sum((want - have).values()), sum((have - want).values())


@dataclass
class Tally:
    """What the clients saw, kept under one lock by the client threads."""

    queries: int = 0
    failed: int = 0
    wrong: int = 0
    inserts: int = 0
    acked: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """The first few failures and wrong answers, as the clients saw them."""
    latencies: list[tuple[float, float]] = field(default_factory=list)
    """(finished at, seconds) of every query and insert."""

    def recent(self, now: float, window: float = WINDOW_S) -> list[float]:
        return [s for at, s in self.latencies[-5000:] if at >= now - window]


@dataclass(frozen=True)
class Snapshot:
    """The cluster as last read by the watcher."""

    nodes: tuple[NodeInfo, ...] = ()
    shards: tuple[dict[str, Any], ...] = ()
    moves: tuple[MigrationRecord, ...] = ()
    failovers: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class StorySummary:
    seconds: float
    queries: int
    failed: int
    wrong: int
    qps: float
    p50_ms: float
    p99_ms: float
    rows_acked: int
    rows_lost: int
    rows_duplicated: int
    moves_done: int
    moves_rolled_back: int
    slowest_fence_ms: float
    recovery_s: float | None
    nodes_before: int
    nodes_after: int
    failures: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not (self.failed or self.wrong or self.rows_lost or self.rows_duplicated)

    def table(self) -> Table:
        table = Table(title="what the clients saw while the cluster changed", show_header=False)
        table.add_column("what")
        table.add_column("value", justify="right")
        recovery = "-" if self.recovery_s is None else f"{self.recovery_s:.2f} s"
        for what, value in (
            ("seconds", f"{self.seconds:.1f}"),
            ("queries run (checked against DuckDB)", f"{self.queries:,}"),
            ("queries and inserts failed", _flag(self.failed)),
            ("wrong answers", _flag(self.wrong)),
            (
                "queries/s, p50, p99",
                f"{self.qps:.1f}/s, {self.p50_ms:.0f} ms, {self.p99_ms:.0f} ms",
            ),
            ("rows acknowledged", f"{self.rows_acked:,}"),
            ("rows lost", _flag(self.rows_lost)),
            ("rows duplicated", _flag(self.rows_duplicated)),
            ("moves done / rolled back", f"{self.moves_done} / {self.moves_rolled_back}"),
            ("slowest fence (writes held)", f"{self.slowest_fence_ms:.0f} ms"),
            ("recovery after SIGKILL", recovery),
            ("nodes before → after", f"{self.nodes_before} → {self.nodes_after}"),
        ):
            table.add_row(what, value)
        return table

    def line(self) -> str:
        recovery = -1.0 if self.recovery_s is None else self.recovery_s
        return (
            f"queries={self.queries} failed={self.failed} wrong={self.wrong} "
            f"rows_acked={self.rows_acked} rows_lost={self.rows_lost} "
            f"rows_duplicated={self.rows_duplicated} moves_done={self.moves_done} "
            f"moves_rolled_back={self.moves_rolled_back} "
            f"slowest_fence_ms={self.slowest_fence_ms:.0f} recovery_s={recovery:.2f}"
        )


def _flag(count: int) -> Text:
    return Text(str(count), style="bold green" if count == 0 else "bold red")


class Clients:
    """Two readers and an inserter. One reader cycles through checked queries (``checked``:
    name → SQL and DuckDB's answer); the other runs point lookups by order key (``lookups``:
    key → DuckDB's row) and counts the inserted rows (the count never goes down)."""

    def __init__(
        self,
        db: Database,
        checked: Mapping[str, tuple[str, pa.Table]],
        lookups: Mapping[int, pa.Table],
        same: Callable[[pa.Table, pa.Table], bool],
    ) -> None:
        self.db = db
        self.checked = dict(checked)
        self.lookups = dict(lookups)
        self.same = same
        self.tally = Tally()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._next_id = 0
        self.threads = [
            threading.Thread(target=self._read_checked, name="demo-reader", daemon=True),
            threading.Thread(target=self._look_up, name="demo-lookups", daemon=True),
            threading.Thread(target=self._insert, name="demo-inserter", daemon=True),
        ]

    def _ran(self, started: float, *, wrong: str | None = None, insert: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            self.tally.latencies.append((now, now - started))
            if insert:
                self.tally.inserts += 1
            else:
                self.tally.queries += 1
            if wrong is not None:
                self.tally.wrong += 1
                self._note(f"wrong answer: {wrong}")

    def _failed(self, what: str, error: BaseException) -> None:
        with self._lock:
            self.tally.failed += 1
            self._note(f"{what}: {type(error).__name__}: {error}")

    def _note(self, text: str) -> None:
        if len(self.tally.failures) < 5:
            self.tally.failures.append(text)

    def check(self, what: str, answer: pa.Table, expected: pa.Table) -> str | None:
        """None when ``answer`` equals DuckDB's ``expected``, else what differed."""
        if self.same(answer, expected):
            return None
        return f"{what}: {answer.num_rows} rows differ from DuckDB's {expected.num_rows}"

    def _read_checked(self) -> None:
        while not self.stop.is_set():
            for name, (query, expected) in self.checked.items():
                if self.stop.is_set():
                    return
                started = time.monotonic()
                try:
                    answer = self.db.sql(query)
                except Exception as error:
                    self._failed(name, error)
                    continue
                self._ran(started, wrong=self.check(name, answer, expected))

    def _look_up(self) -> None:
        last_count = 0
        while not self.stop.is_set():
            for key, expected in self.lookups.items():
                if self.stop.wait(0.01):
                    return
                started = time.monotonic()
                try:
                    answer = self.db.sql(LOOKUP_SQL, [key])
                except Exception as error:
                    self._failed(f"lookup {key}", error)
                    continue
                self._ran(started, wrong=self.check(f"order {key}", answer, expected))
            started = time.monotonic()
            try:
                count = self.db.sql(f"SELECT count(*) AS n FROM {EVENTS}")[0][0].as_py()
            except Exception as error:
                self._failed("count", error)
                continue
            went_down = f"the count went down: {last_count} -> {count}"
            self._ran(started, wrong=went_down if count < last_count else None)
            last_count = count

    def _insert(self) -> None:
        while not self.stop.wait(0.05):
            start = self._next_id
            self._next_id += BATCH
            ids = pa.array(range(start, start + BATCH), pa.int64())
            rows = pa.table({"id": ids, "amount": pc.multiply(ids, 3)})
            started = time.monotonic()
            try:
                self.db.insert(EVENTS, rows)
            except Exception as error:
                self._failed("insert", error)
                continue
            with self._lock:
                self.tally.acked.extend(range(start, start + BATCH))
            self._ran(started, insert=True)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=RECOVERY_TIMEOUT_S)


class Story:
    """The scripted changes, the watcher that reads the cluster while they run, and the
    screen (or plain lines) that shows both."""

    def __init__(
        self,
        db: Database,
        clients: Clients,
        console: Console,
        *,
        live: bool,
        pace_s: float = 3.0,
        title: str = "shardflow: zero-downtime scaling",
    ) -> None:
        self.db = db
        self.clients = clients
        self.console = console
        self.live = live
        self.pace_s = pace_s
        self.title = title
        self.started = time.monotonic()
        self.wall_started = time.time()
        self.snapshot = Snapshot()
        self.events: list[tuple[float, str]] = []
        self.steps: list[tuple[str, Callable[[], str]]] = [
            ("steady load: readers checked against DuckDB, an inserter", self._steady),
            ("add two nodes", self._add_two),
            ("the balancer moves shards onto them", self._balance),
            ("migrate a shard by hand", self._migrate),
            ("split a shard by hand", self._split),
            ("drain a node", self._drain),
            ("SIGKILL a worker", self._kill),
            (f"a slower device joins (simulated, {SLOWDOWN:g}x slower)", self._add_slow),
            ("settle", self._steady),
        ]
        self.results: list[str] = []
        self.current = -1
        self.recovery_s: float | None = None
        self._seen_moves: set[str] = set()
        self._seen_failovers = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="demo-watcher", daemon=True)

    # -- what happens --------------------------------------------------------------------
    def say(self, text: str) -> None:
        at = time.monotonic() - self.started
        self.events.append((at, text))
        if not self.live:
            self.console.print(
                f"[{at:6.1f}s] {text}", markup=False, highlight=False, soft_wrap=True
            )

    def run(self) -> StorySummary:
        nodes_before = len(self.db.cluster.nodes())
        self.snapshot = self._read() or self.snapshot
        self._seen_moves = {m.move_id for m in self.snapshot.moves}
        self.clients.start()
        self._watcher.start()
        try:
            if self.live:
                with Live(get_renderable=self.render, console=self.console, refresh_per_second=4):
                    self._run_steps()
            else:
                self._run_steps()
        finally:
            self.clients.join()
            self._stop.set()
            self._watcher.join(timeout=10)
        return self._summary(nodes_before)

    def _run_steps(self) -> None:
        for index, (title, action) in enumerate(self.steps):
            self.current = index
            self.say(f"step {index + 1}/{len(self.steps)}: {title}")
            result = action()
            self.results.append(result)
            self.say(f"  {result}")
            if not self.live:
                self.console.print(
                    self._status_line(), markup=False, highlight=False, soft_wrap=True
                )
        self.current = len(self.steps)

    def _steady(self) -> str:
        time.sleep(self.pace_s)
        tally = self.clients.tally
        return f"{tally.queries:,} queries, {len(tally.acked):,} rows acknowledged so far"

    def _add_two(self) -> str:
        added = [self.db.cluster.add_node() for _ in range(2)]
        return f"{' and '.join(added)} joined ({len(self.db.cluster.nodes())} nodes)"

    def _rebalance(self) -> list[dict[str, Any]]:
        for _ in range(5):
            try:
                return list(self.db.cluster.rebalance(dry_run=False).get("moves", []))
            except MoveRefusedError:  # a move of the same shards is running: ask again
                time.sleep(0.5)
        return []

    def _balance(self) -> str:
        moves = self._rebalance()
        time.sleep(self.pace_s / 2)
        done = sum(m.get("phase") == "done" for m in moves)
        return f"the balancer made {len(moves)} moves ({done} done)"

    def _distributed(self) -> list[dict[str, Any]]:
        shards = self.db.cluster.shards().to_pylist()
        return sorted(
            (s for s in shards if s["kind"] == "distributed"),
            key=lambda s: int(s["bytes"]),
            reverse=True,
        )

    def _migrate(self) -> str:
        nodes = [n for n in self.db.cluster.nodes() if n.alive and not n.simulated]
        for shard in self._distributed()[:5]:
            others = [n for n in nodes if n.node_id != shard["node"]]
            if not others:
                break
            target = min(others, key=lambda n: n.bytes).node_id
            try:
                moved = self.db.cluster.migrate(str(shard["shard"]), to=target)
            except MoveRefusedError:
                continue
            return (
                f"{shard['shard']} {shard['node']} → {target}: {moved.rows:,} rows in "
                f"{moved.seconds:.2f}s, writes held {moved.fence_seconds * 1000:.0f} ms"
            )
        return "no shard could move"

    def _split(self) -> str:
        for shard in self._distributed()[:5]:
            try:
                done = self.db.cluster.split(str(shard["shard"]))
            except MoveRefusedError:
                continue
            return f"{shard['shard']} → {', '.join(done.new_shards[:2])} in {done.seconds:.2f}s"
        return "no shard could split"

    def _drain(self) -> str:
        nodes = sorted(n.node_id for n in self.db.cluster.nodes() if n.alive)
        node = "node-1" if "node-1" in nodes else nodes[0]
        moved = self.db.cluster.drain(node, deadline=RECOVERY_TIMEOUT_S)
        return f"{node}: {len(moved)} moves took its shards; it stopped"

    def _kill(self) -> str:
        counts = Counter(s["node"] for s in self._distributed())
        alive = [n.node_id for n in self.db.cluster.nodes() if n.alive]
        victim = max(alive, key=lambda n: (counts.get(n, 0), n))
        before = len(self.db.cluster.failovers())
        pid = sigkill_worker(self.db, victim)
        self.say(f"  SIGKILL {victim} (pid {pid}), holding {counts.get(victim, 0)} shards")
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while time.monotonic() < deadline:
            failovers = self.db.cluster.failovers()
            if len(failovers) > before:
                latest = failovers[-1]
                self.recovery_s = float(latest["seconds"])
                return (
                    f"{latest['node']} declared dead; its shards served again from the "
                    f"durable copy in {self.recovery_s:.2f}s"
                )
            time.sleep(0.1)
        raise TimeoutError(f"no failover {RECOVERY_TIMEOUT_S:g}s after killing {victim}")

    def _add_slow(self) -> str:
        node = self.db.cluster.add_node(simulate_slowdown=SLOWDOWN)
        moves = self._rebalance()
        info = next((n for n in self.db.cluster.nodes() if n.node_id == node), None)
        capacity = f"capacity {info.capacity:.2f}, " if info else ""
        held = info.shards if info else 0
        return f"{node} joined: {capacity}{len(moves)} moves, it holds {held} shards"

    # -- watching ------------------------------------------------------------------------
    def _read(self) -> Snapshot | None:
        try:
            cluster = self.db.cluster
            return Snapshot(
                tuple(sorted(cluster.nodes(), key=lambda n: _node_number(n.node_id))),
                tuple(cluster.shards().to_pylist()),
                tuple(cluster.migrations()),
                tuple(cluster.failovers()),
            )
        except Error:  # the coordinator restarts, a node is gone: keep the last view
            return None

    def _watch(self) -> None:
        last_status = time.monotonic()
        while not self._stop.wait(0.5):
            snapshot = self._read()
            if snapshot is None:
                continue
            self.snapshot = snapshot
            for move in snapshot.moves:
                if move.phase in TERMINAL and move.move_id not in self._seen_moves:
                    self._seen_moves.add(move.move_id)
                    self.say("  " + describe_move(move))
            for failover in snapshot.failovers[self._seen_failovers :]:
                self.say(
                    f"  failover: {failover['node']}'s shards served again after "
                    f"{float(failover['seconds']):.2f}s"
                )
            self._seen_failovers = len(snapshot.failovers)
            if not self.live and time.monotonic() - last_status >= 5:
                last_status = time.monotonic()
                self.console.print(
                    self._status_line(), markup=False, highlight=False, soft_wrap=True
                )

    # -- showing -------------------------------------------------------------------------
    def _rates(self) -> tuple[float, float, float]:
        recent = self.clients.tally.recent(time.monotonic())
        return (
            len(recent) / WINDOW_S,
            percentile(recent, 0.5) * 1000,
            percentile(recent, 0.99) * 1000,
        )

    def _status_line(self) -> str:
        qps, p50, p99 = self._rates()
        tally = self.clients.tally
        moving = sum(m.phase not in TERMINAL for m in self.snapshot.moves)
        at = time.monotonic() - self.started
        return (
            f"[{at:6.1f}s] {len(self.snapshot.nodes)} nodes · {qps:.0f} ops/s · p50 {p50:.0f} ms"
            f" · p99 {p99:.0f} ms · {tally.queries:,} queries · {tally.failed} failed · "
            f"{tally.wrong} wrong · {len(tally.acked):,} rows acked · {moving} moves in flight"
        )

    def render(self) -> RenderableType:
        return Panel(
            Group(
                self._steps_view(),
                self._clients_view(),
                self._map_view(),
                self._moves_view(),
                self._events_view(),
            ),
            title=self.title,
        )

    def _steps_view(self) -> Table:
        table = Table.grid(padding=(0, 1))
        for index, (title, _) in enumerate(self.steps):
            if index < self.current:
                mark, style, result = "✓", "green", self.results[index]
            elif index == self.current:
                mark, style, result = "▶", "bold yellow", "…"
            else:
                mark, style, result = "·", "dim", ""
            table.add_row(Text(mark, style=style), Text(title, style=style), Text(result))
        return table

    def _clients_view(self) -> Text:
        qps, p50, p99 = self._rates()
        tally = self.clients.tally
        text = Text()
        text.append(f"{qps:6.1f} ops/s   p50 {p50:5.0f} ms   p99 {p99:5.0f} ms   ", "bold")
        text.append(f"queries {tally.queries:,}   ")
        text.append(f"failed {tally.failed}   ", "green" if not tally.failed else "bold red")
        text.append(f"wrong {tally.wrong}   ", "green" if not tally.wrong else "bold red")
        text.append(f"rows acknowledged {len(tally.acked):,}")
        return text

    def _map_view(self) -> Table:
        tables = sorted({str(s["table"]) for s in self.snapshot.shards if s["kind"] != "replica"})
        colour = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(tables)}
        held: dict[str, list[str]] = {}
        for shard in self.snapshot.shards:
            if shard["kind"] == "distributed":
                held.setdefault(str(shard["node"]), []).append(str(shard["table"]))
        table = Table(title="nodes and their shards (one square a shard)", title_justify="left")
        for column in ("node", "device", "capacity", "MiB", "shards"):
            table.add_column(column, justify="left" if column in ("node", "device") else "right")
        table.add_column("map")
        for node in self.snapshot.nodes:
            squares = Text()
            for name in sorted(held.get(node.node_id, [])):
                squares.append("■", colour[name])
            device = f"{node.vendor}: {node.model}"
            style = "" if node.alive and node.health == "healthy" else "red"
            table.add_row(
                Text(node.node_id, style=style),
                device if node.alive else Text("not answering", style="red"),
                f"{node.capacity:.2f}",
                f"{node.bytes / (1 << 20):.1f}",
                str(len(held.get(node.node_id, []))),
                squares,
            )
        legend = Text("  ".join(f"■ {name}" for name in tables))
        for name in tables:
            legend.highlight_words([f"■ {name}"], colour[name])
        table.caption = legend
        return table

    def _moves_view(self) -> Table:
        table = Table(title="moves (in flight, then the latest)", title_justify="left")
        for column in ("kind", "shards", "from → to", "phase", "s", "fence ms", "reason"):
            table.add_column(column)
        moving = [m for m in self.snapshot.moves if m.phase not in TERMINAL]
        latest = [m for m in self.snapshot.moves if m.phase in TERMINAL][-3:]
        for move in [*moving, *reversed(latest)]:
            phase_style = {"done": "green", "rolled_back": "red"}.get(move.phase, "bold yellow")
            table.add_row(
                move.kind,
                ", ".join(move.shards[:2]) + (" …" if len(move.shards) > 2 else ""),
                f"{','.join(move.from_nodes)} → {','.join(move.to_nodes)}",
                Text(move.phase, style=phase_style),
                f"{move.seconds:.1f}",
                f"{move.fence_seconds * 1000:.0f}",
                move.reason[:40],
            )
        return table

    def _events_view(self) -> Text:
        text = Text()
        for at, line in self.events[-5:]:
            text.append(f"{at:6.1f}s ", "dim")
            text.append(line.strip() + "\n")
        return text

    # -- the end -------------------------------------------------------------------------
    def _summary(self, nodes_before: int) -> StorySummary:
        tally = self.clients.tally
        present = self.db.sql(f"SELECT id FROM {EVENTS}").column("id").to_pylist()
        lost, extra = missing_and_extra(tally.acked, present)
        if lost or extra:
            tally.failures.append(f"{lost} acknowledged rows missing, {extra} unexpected")
        ours = [m for m in self.db.cluster.migrations() if m.started_at >= self.wall_started]
        seconds = time.monotonic() - self.started
        latencies = [s for _, s in tally.latencies]
        return StorySummary(
            seconds=seconds,
            queries=tally.queries,
            failed=tally.failed,
            wrong=tally.wrong,
            qps=tally.queries / seconds if seconds else 0.0,
            p50_ms=percentile(latencies, 0.5) * 1000,
            p99_ms=percentile(latencies, 0.99) * 1000,
            rows_acked=len(tally.acked),
            rows_lost=lost,
            rows_duplicated=extra,
            moves_done=sum(m.phase == "done" for m in ours),
            moves_rolled_back=sum(m.phase == "rolled_back" for m in ours),
            slowest_fence_ms=max((m.fence_seconds for m in ours), default=0.0) * 1000,
            recovery_s=self.recovery_s,
            nodes_before=nodes_before,
            nodes_after=len(self.db.cluster.nodes()),
            failures=tuple(tally.failures),
        )


def describe_move(move: MigrationRecord) -> str:
    what = ", ".join(move.shards[:2]) + (" …" if len(move.shards) > 2 else "")
    route = f"{','.join(move.from_nodes)} → {','.join(move.to_nodes)}"
    if move.phase != "done":
        return f"{move.kind} {what} {route} rolled back: {move.outcome}"
    return (
        f"{move.kind} {what} {route} done in {move.seconds:.2f}s "
        f"(writes held {move.fence_seconds * 1000:.0f} ms; {move.reason})"
    )


def sigkill_worker(db: Database, node: str) -> int:
    """Kill the process of ``node``'s worker with SIGKILL, as a crash; returns its pid.
    Only for a cluster on this machine (the demo's embedded one)."""
    [pid] = [n.pid for n in db.cluster.nodes() if n.node_id == node and n.alive]
    os.kill(pid, signal.SIGKILL)
    return pid


def _node_number(node_id: str) -> tuple[int, str]:
    digits = "".join(c for c in node_id if c.isdigit())
    return (int(digits) if digits else 0, node_id)
