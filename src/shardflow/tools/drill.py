"""A node-loss drill for a multi-node cluster: inserts and checked queries run while shards
move live between Ray nodes and whole Ray nodes are killed; the report says what the
clients saw (failed operations, wrong answers, lost or duplicated rows) and how long the
cluster took to serve every shard again after each loss.

``python -m shardflow.tools.drill --address A --data-dir D --moves 20 --kill ray-2`` runs it
against the local cluster of ``shardflow cluster up``; ``bench/cluster.py`` wraps it.

With ``--nemesis kill,pause,head,flaky,partition,disk --faults N --seed S`` it plays a
seeded schedule of faults under the same checked workload — a data node SIGKILLed (a new one
joins after), a data node SIGSTOPped for a while, the head SIGKILLed (a cluster up with
``--ha``), a node whose worker fails a share of its fragments joining (a service started
with ``test_flaky_node="ray-flaky=SHARE"``), the network cut (a cluster in network
namespaces, the drill run in its clients' namespace: a data node from the head and the
coordinator, this client from a data node, or what a data node sends this client), the
data directory full for a while (one on a small filesystem, a tmpfs of fixed size: inserts
are refused meanwhile and tried again, with the same batch id, until they land) — prints
each fault with its recovery time, and as its last line
``faults=N failed_ops=F lost=L dup=D stale_reads=S max_recovery_s=R``
(``bench/nemesis.py`` wraps it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from shardflow.api import Database, connect
from shardflow.errors import Error, MigrationError, MoveRefusedError, StorageError
from shardflow.runtime.ray.local import attached_node
from shardflow.tools.localcluster import LocalNode, LocalRayCluster, descendants
from shardflow.tools.netns import CLIENT

EVENTS = "drill_events"
FACTS = "drill_facts"
CHECKED_SQL = f"SELECT g, count(*) AS n, sum(x) AS s FROM {FACTS} GROUP BY g ORDER BY g"
"""The checked reader's query: its answer is compared with DuckDB's over the same rows."""
BIG = "drill_big"
BIG_ROWS = 200_000
"""A table big enough that moving a shard of it takes a while (with a bandwidth cap)."""
MID_MOVE = "coordinator-mid-move"
"""A kill target: the coordinator's node, while it runs a move between two other nodes."""
MOVE_HEAD_START_S = 0.5
LOST = "lost"
"""A node to rejoin: the name of the first node the drill killed."""
RESULTS = "results"
"""A kill target: a node holding fragment results a query has not read yet."""
RESULT_HOLD_S = 30.0
HEAD = "head"
"""A kill target: the Ray head (GCS) of a cluster started with ``--ha``; its keeper starts it
again, and the workers and the coordinator serve meanwhile."""
HELD_SQL = f"SELECT id, pad FROM {BIG} WHERE id % 3 = 0"
"""Fragment results of a few hundred KB each: kept in the workers' object stores (small
ones travel inside the reply and cannot be lost with a node)."""
HELD_ROWS = len(range(0, BIG_ROWS, 3))
BATCH = 25
RECOVERY_TIMEOUT_S = 120.0
TABLES = (FACTS, EVENTS, BIG)
FLAKY = "flaky"
FLAKY_NODE = "ray-flaky"
"""The Ray node a flaky fault starts: its worker fails a share of its fragments where the
service runs with ``test_flaky_node="ray-flaky=SHARE"`` (``bench/nemesis.py`` does)."""
PARTITION = "partition"
DISK = "disk"
NEMESIS_KINDS = ("kill", "pause", HEAD, FLAKY, PARTITION, DISK)
"""The faults the nemesis plays."""
DISK_FULL_S = 3.0
"""How long the nemesis keeps the data directory full."""
SMALL_DISK_BYTES = 1 << 30
"""The disk fault fills the data directory's filesystem: only one of at most this size."""
BALLOON = ".drill-balloon"
REFUSED_PAUSE_S = 0.1
"""How long the inserter waits before it tries a refused insert again."""
PAUSE_S = 2.0
"""How long a paused node stays stopped: under the 3 s in which Ray declares a node dead,
so that it comes back as itself (a longer pause is a node loss)."""
CUTS = {"node": 6.0, "client": 4.0, "one-way": 4.0}
"""The partitions, and how long each lasts: a data node cut off from the head and the
coordinator (longer than the 3 s in which the head declares it dead: it is failed over while
it still runs, and its raylet ends once it hears it was), this client cut off from a data
node both ways, and what a data node sends this client dropped (shorter than TCP's give-up
time: the calls wait, then go on)."""
NODE_END_WAIT_S = 30.0
OVERLAP_SHARE = 0.25
"""The share of the nemesis's faults (other than pauses) during which another data node is
paused too: faults overlap."""


@dataclass
class DrillReport:
    recovery_s: list[float] = field(default_factory=list)
    """Per node lost: seconds from the kill until every shard was served again."""
    failed_ops: int = 0
    wrong_answers: int = 0
    lost_rows: int = 0
    duplicated_rows: int = 0
    moves: int = 0
    move_failures: int = 0
    queries: int = 0
    inserts: int = 0
    failures: list[str] = field(default_factory=list)
    """The first few failures, as the clients saw them."""
    joined: list[str] = field(default_factory=list)
    """Nodes that joined on Ray nodes started during the drill."""
    lost: list[str] = field(default_factory=list)
    """The Ray nodes killed, in order."""
    results_recomputed: int = 0
    """Query reruns because results the query had not read yet were lost with a node."""
    held_scan: str = ""
    """Where the held scan's results were and which node was killed."""
    interrupted_moves: list[str] = field(default_factory=list)
    """How each move cut short by the loss of the coordinator's node ended."""
    stale_reads: int = 0
    """Counts that missed rows acknowledged before the count started (or went down)."""
    refused_inserts: int = 0
    """Inserts refused because the data directory was full (tried again until they land)."""
    faults: list[str] = field(default_factory=list)
    """The nemesis's faults, each with its recovery time."""
    fault_recovery_s: list[float] = field(default_factory=list)

    def nemesis_line(self) -> str:
        worst = max(self.fault_recovery_s, default=0.0)
        return (
            f"faults={len(self.faults)} failed_ops={self.failed_ops} lost={self.lost_rows} "
            f"dup={self.duplicated_rows} stale_reads={self.stale_reads} "
            f"max_recovery_s={worst:.2f}"
        )

    def line(self) -> str:
        worst = max(self.recovery_s, default=0.0)
        return (
            f"node_loss_recovery_s={worst:.2f} failed_ops={self.failed_ops} "
            f"lost_rows={self.lost_rows} moves={self.moves} move_failures={self.move_failures}"
        )


def events(start: int, count: int) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + count), pa.int64())})


def facts(rows: int) -> pa.Table:
    ids = range(rows)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "g": pa.array([i % 13 for i in ids], pa.int64()),
            "x": pa.array([(i * 7) % 1000 for i in ids], pa.int64()),
        }
    )


def oracle(table: pa.Table) -> list[dict[str, Any]]:
    """DuckDB's answer to the checked query over ``table``."""
    con = duckdb.connect()
    try:
        con.register(FACTS, table)
        answer: list[dict[str, Any]] = con.sql(CHECKED_SQL).to_arrow_table().to_pylist()
        return answer
    finally:
        con.close()


class Workload:
    """An inserter of unique ids, a reader that counts them (the count never goes down) and
    a reader whose answers are checked against DuckDB."""

    def __init__(
        self, db: Database, expected: list[dict[str, Any]], next_id: int, initial: int = 0
    ) -> None:
        self.db = db
        self.expected = expected
        self.next_id = next_id
        self.initial = initial
        """Rows of the events table before the drill: a count never reads fewer than these
        and the rows acknowledged before it started."""
        self.acked: list[int] = []
        self.report = DrillReport()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._insert, daemon=True),
            threading.Thread(target=self._count, daemon=True),
            threading.Thread(target=self._check, daemon=True),
        ]

    def _failed(self, what: str, error: BaseException) -> None:
        with self._lock:
            self.report.failed_ops += 1
            if len(self.report.failures) < 5:
                self.report.failures.append(f"{what}: {type(error).__name__}: {error}")

    def _insert(self) -> None:
        while not self.stop.is_set():
            start = self.next_id
            self.next_id += BATCH
            batch_id = f"drill-{start}"
            while True:
                try:
                    self.db.insert(EVENTS, events(start, BATCH), batch_id=batch_id)
                except StorageError:  # the data directory is full: nothing of it was kept;
                    self.report.refused_inserts += 1  # as a pipeline would, try it again
                    if not self.stop.wait(REFUSED_PAUSE_S):
                        continue
                except Exception as error:
                    self._failed("insert", error)
                    break
                else:
                    self.acked.extend(range(start, start + BATCH))
                    self.report.inserts += 1
                break

    def _count(self) -> None:
        last = 0
        while not self.stop.is_set():
            floor = max(last, self.initial + len(self.acked))  # acknowledged before it starts
            try:
                count = self.db.sql(f"SELECT count(*) FROM {EVENTS}")[0][0].as_py()
            except Exception as error:
                self._failed("count", error)
                continue
            self.report.queries += 1
            if count < floor:
                self.report.stale_reads += 1
                self._failed("count", AssertionError(f"a stale read: {count} rows, {floor} known"))
            last = count
            self.stop.wait(0.05)

    def _check(self) -> None:
        while not self.stop.is_set():
            try:
                answer = self.db.sql(CHECKED_SQL).to_pylist()
            except Exception as error:
                self._failed("checked query", error)
                continue
            self.report.queries += 1
            if answer != self.expected:
                self.report.wrong_answers += 1
                self._failed("checked query", AssertionError("answer differs from DuckDB's"))
            self.stop.wait(0.05)

    def __enter__(self) -> Workload:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=RECOVERY_TIMEOUT_S)


def prepare(db: Database, rows: int) -> tuple[list[dict[str, Any]], int]:
    """Create the drill's tables (once per data directory); returns DuckDB's answer to the
    checked query and the first id free for inserts."""
    table = facts(rows)
    names = set(db.tables().column("name").to_pylist())
    if FACTS not in names:
        db.create_table(FACTS, table, distributed_by="id")
    if EVENTS not in names:
        db.create_table(EVENTS, events(0, rows), distributed_by="id")
    if BIG not in names:
        ids = pa.array(range(BIG_ROWS), pa.int64())
        padding = pa.array(["x" * 40] * BIG_ROWS)
        db.create_table(BIG, pa.table({"id": ids, "pad": padding}), distributed_by="id")
    top = db.sql(f"SELECT coalesce(max(id), -1) FROM {EVENTS}")[0][0].as_py()
    return oracle(table), int(top) + 1


def forced_moves(db: Database, count: int, report: DrillReport) -> None:
    """Move ``count`` shards of the events table to other nodes, one after another."""
    done = attempts = 0
    while done < count and attempts < count * 4:
        attempts += 1
        alive = sorted(n.node_id for n in db.cluster.nodes() if n.alive)
        shards = [s for s in db.cluster.shards().to_pylist() if s["table"] == EVENTS]
        if len(alive) < 2 or not shards:
            break
        shard = shards[done % len(shards)]
        others = [n for n in alive if n != shard["node"]]
        target = others[done % len(others)]
        try:
            db.cluster.migrate(str(shard["shard"]), target)
        except MigrationError as error:
            report.move_failures += 1
            report.failures.append(f"move: {error}")
        except MoveRefusedError:  # moving already (the balancer), or gone: pick again
            continue
        done += 1
    report.moves = done


def wait_served(db: Database, lost_ray_node: str, started: float) -> float:
    """Seconds from ``started`` until no member runs on the lost Ray node and a query
    reading every shard of the events table answers."""
    deadline = started + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            nodes = db.cluster.nodes()
            if all(n.alive and n.ray_node_id != lost_ray_node for n in nodes):
                db.sql(f"SELECT count(*) FROM {EVENTS}")
                return time.monotonic() - started
        except Error:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"shards were not all served {RECOVERY_TIMEOUT_S:g}s after the loss")


def kill(db: Database, local: LocalRayCluster, target: str) -> tuple[str, str]:
    """Kill a Ray node (``ray-2``, ``coordinator``: the node the coordinator runs on, or
    ``head``) with SIGKILL; returns its name and Ray node id. A killed head is back (its
    keeper started it again) when this returns."""
    if target == HEAD:
        head = local.head_process()
        killed = local.kill_head()
        local.wait_head(killed, RECOVERY_TIMEOUT_S)
        return HEAD, head[1] if head is not None else ""
    if target in ("coordinator", MID_MOVE):
        host = db.cluster.coordinator_host()
        target = next(n.name for n in local.nodes() if n.node_id == host)
    node = local.remove_node(target, kill=True)
    return node.name, node.node_id


def results_node(db: Database, local: LocalRayCluster, host: str) -> str:
    """The Ray node, neither the head nor the coordinator's, whose data nodes hold the most
    shards of the big table (so it holds results of the held scan). The big table's shards
    are first spread over two Ray nodes at least: with every shard on one node the scan runs
    whole there and its answer comes back in the reply, with nothing held to lose."""
    alive = [n for n in db.cluster.nodes() if n.alive]
    ray_node = {n.node_id: n.ray_node_id for n in alive}
    shards = [s for s in db.cluster.shards().to_pylist() if s["table"] == BIG]
    held = Counter(ray_node.get(str(s["node"]), "") for s in shards)
    candidates = [n for n in local.nodes() if not n.head and n.node_id != host]
    best = max(candidates, key=lambda n: held[n.node_id], default=None)
    if best is None or len(shards) < 2:
        raise RuntimeError("no Ray node beside the head's and the coordinator's, or one shard")
    if not held[best.node_id]:
        # the moves and the drain before left every shard on the head's or the
        # coordinator's node (placement chooses by load): one goes over to it now
        to = next(n.node_id for n in alive if n.ray_node_id == best.node_id)
        db.cluster.migrate(shards[0]["shard"], to)
    elif held[best.node_id] == len(shards):  # all there: one goes elsewhere
        to = next(n.node_id for n in alive if n.ray_node_id != best.node_id)
        db.cluster.migrate(shards[0]["shard"], to)
    return best.name


class HeldResults:
    """A scan of the big table whose fragment results wait on the workers (a second session
    with ``test_hold_results_s``) while a node holding some of them is killed: the query must
    run again and answer right."""

    def __init__(self, local: LocalRayCluster, report: DrillReport) -> None:
        self.report = report
        holder = connect(
            address=local.address, data_dir=local.data_dir, test_hold_results_s=RESULT_HOLD_S
        )
        assert isinstance(holder, Database)  # a Ray address: never a remote service
        self.holder = holder
        self.answer: pa.Table | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._scan, daemon=True)
        self.thread.start()
        session = self.holder._session
        assert session is not None
        if not session.results_held.wait(RECOVERY_TIMEOUT_S):  # the fragments ran; results wait
            raise RuntimeError("the held scan's fragments did not finish")

    def holder_node(self, db: Database, local: LocalRayCluster, chosen: str) -> str:
        """A Ray node (neither the head nor the coordinator's) whose workers hold results
        of the scan; ``chosen`` where it is one of them or none is."""
        session = self.holder._session
        assert session is not None
        ray_node = {n.node_id: n.ray_node_id for n in db.cluster.nodes() if n.alive}
        host = db.cluster.coordinator_host()
        holding = {ray_node.get(node, "") for node in session.results_held_on}
        names = {n.node_id: n.name for n in local.nodes() if not n.head and n.node_id != host}
        found = sorted(names[r] for r in holding if r in names)
        target = chosen if chosen in found or not found else found[0]
        self.report.held_scan = (
            f"results held on {len(session.results_held_on)} worker(s), "
            f"{', '.join(found) or 'none'} killable; {target} killed"
        )
        return target

    def release(self) -> None:
        """The node is killed: the scan reads its results now (from a node that is gone)."""
        session = self.holder._session
        assert session is not None
        session.results_released.set()

    def _scan(self) -> None:
        try:
            self.answer = self.holder.sql(HELD_SQL)
        except BaseException as error:  # reported by settle()
            self.error = error

    def settle(self) -> None:
        self.thread.join(timeout=RECOVERY_TIMEOUT_S)
        try:
            if self.error is not None or self.answer is None:
                self.report.failed_ops += 1
                self.report.failures.append(f"held scan: {self.error!r}")
                return
            reruns = self.holder.last_report.reruns if self.holder.last_report else 0
            self.report.results_recomputed += reruns
            if self.answer.num_rows != HELD_ROWS:
                self.report.wrong_answers += 1
                self.report.failures.append(f"held scan: {self.answer.num_rows} rows")
        finally:
            self.holder.close()


class MoveInFlight:
    """A live move of a shard of the big table between two nodes other than the
    coordinator's, started on a thread (killing the coordinator's node cuts it short)."""

    def __init__(self, db: Database, report: DrillReport) -> None:
        self.db, self.report = db, report
        host = db.cluster.coordinator_host()
        ray_node = {n.node_id: n.ray_node_id for n in db.cluster.nodes() if n.alive}
        shards = self._off_the_coordinator(db, ray_node, host)
        if not shards:
            # the failover before (or placement, which chooses by load) left every shard
            # on the coordinator's node: one goes over to another node first, unhurried
            big = [s for s in db.cluster.shards().to_pylist() if s["table"] == BIG]
            away = [n for n, r in ray_node.items() if r != host]
            if not big or not away:
                raise RuntimeError("no shard of the big table, or no node beside the coordinator's")
            db.cluster.migrate(str(big[0]["shard"]), away[0])
            shards = self._off_the_coordinator(db, ray_node, host)
        if not shards:
            raise RuntimeError("no shard of the big table off the coordinator's node")
        self.shard = str(shards[0]["shard"])
        others = [n for n, r in ray_node.items() if r != host and n != shards[0]["node"]]
        if not others:
            raise RuntimeError("a move beside the coordinator needs 3 serving nodes")
        self.thread = threading.Thread(target=self._move, args=(others[0],), daemon=True)
        self.thread.start()
        time.sleep(MOVE_HEAD_START_S)  # copying by now

    @staticmethod
    def _off_the_coordinator(
        db: Database, ray_node: dict[str, str], host: str
    ) -> list[dict[str, Any]]:
        return [
            s
            for s in db.cluster.shards().to_pylist()
            if s["table"] == BIG and ray_node.get(str(s["node"]), host) != host
        ]

    def _move(self, target: str) -> None:
        try:
            self.db.cluster.migrate(self.shard, target)
        except Error:  # cut short: the restarted coordinator finishes or rolls it back
            pass

    def settle(self) -> None:
        """Wait for the move's end and record how it ended; the big table must still hold
        every row once."""
        self.thread.join(timeout=RECOVERY_TIMEOUT_S)
        ended = [m for m in self.db.cluster.migrations() if self.shard in m.shards]
        self.report.interrupted_moves += [f"{m.phase}: {m.outcome}" for m in ended[-1:]]
        if not ended or ended[-1].phase not in ("done", "rolled_back"):
            self.report.move_failures += 1
            self.report.failures.append(f"the move of {self.shard} did not end: {ended[-1:]}")
        count, total = self.db.sql(f"SELECT count(*), sum(id) FROM {BIG}").to_pylist()[0].values()
        if (count, total) != (BIG_ROWS, BIG_ROWS * (BIG_ROWS - 1) // 2):
            self.report.wrong_answers += 1
            self.report.failures.append(f"{BIG} holds {count} rows (sum {total}) after the move")


def drain(db: Database, local: LocalRayCluster, name: str, report: DrillReport) -> None:
    """Take a Ray node away gracefully: its shards move off live, then it stops."""
    node = local.node(name)
    try:
        db.cluster.drain_host(node.node_id, deadline=RECOVERY_TIMEOUT_S)
    except Error as error:
        report.move_failures += 1
        report.failures.append(f"drain {name}: {error}")
        return
    local.remove_node(name)


def rejoin(db: Database, local: LocalRayCluster, name: str | None, report: DrillReport) -> None:
    """Start a Ray node (named ``name``, else a new name) and wait until a worker joined
    on it."""
    node = local.add_node(name=name)
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        joined = [n.node_id for n in db.cluster.nodes() if n.ray_node_id == node.node_id]
        if joined:
            report.joined += joined
            return
        time.sleep(0.2)
    raise TimeoutError(f"no worker joined on {name} within {RECOVERY_TIMEOUT_S:g}s")


def run_drill(
    db: Database,
    local: LocalRayCluster,
    *,
    rows: int = 20_000,
    moves: int = 20,
    grow: int = 0,
    drains: list[str] | tuple[str, ...] = (),
    kills: list[str] | tuple[str, ...] = (),
    rejoins: list[str] | tuple[str, ...] = (),
    settle_s: float = 2.0,
    nemesis: list[str] | tuple[str, ...] = (),
    faults: int = 0,
    seed: int = 0,
    overlap: float = OVERLAP_SHARE,
) -> DrillReport:
    """Under load: ``grow`` new Ray nodes join, ``moves`` shards move live, the Ray nodes
    in ``drains`` are drained and stopped, those in ``kills`` are SIGKILLed one after the
    other, and Ray nodes named ``rejoins`` start again; then the nemesis plays ``faults``
    faults of the ``nemesis`` kinds, chosen with ``seed``."""
    expected, next_id = prepare(db, rows)
    initial = db.sql(f"SELECT count(*) FROM {EVENTS}")[0][0].as_py()
    with Workload(db, expected, next_id, initial) as load:
        time.sleep(settle_s / 2)
        for _ in range(grow):
            rejoin(db, local, None, load.report)
        forced_moves(db, moves, load.report)
        for name in drains:
            drain(db, local, name, load.report)
        lost = load.report.lost
        for target in kills:
            move = MoveInFlight(db, load.report) if target == MID_MOVE else None
            if target == RESULTS:  # chosen before the scan holds its results: the kill then
                # comes at once, well within the hold, however slow the cluster's reports
                target = results_node(db, local, db.cluster.coordinator_host())
                scan = HeldResults(local, load.report)
                # where the scan's results are now (a move may have taken the shard the
                # choice went by elsewhere meanwhile): a node holding some of them
                target = scan.holder_node(db, local, target)
                held: HeldResults | None = scan
            else:
                held = None
            started = time.monotonic()
            name, ray_node_id = kill(db, local, target)
            if held is not None:  # killed: the held scan reads its results now
                held.release()
            lost.append(name)
            load.report.recovery_s.append(wait_served(db, ray_node_id, started))
            if move is not None:
                move.settle()
            if held is not None:
                held.settle()
            time.sleep(settle_s)
        for name in rejoins:  # "lost": the first node this drill killed
            rejoin(db, local, lost[0] if name == LOST and lost else name, load.report)
        if faults:
            play_nemesis(db, local, nemesis, faults, seed, load.report, settle_s, overlap)
        time.sleep(settle_s)
    report = load.report
    got = db.sql(f"SELECT id FROM {EVENTS} WHERE id >= {next_id}").column("id").to_pylist()
    report.lost_rows = len(set(load.acked) - set(got))
    report.duplicated_rows = len(got) - len(set(got))
    kept = db.sql(f"SELECT count(*) FROM {EVENTS} WHERE id < {next_id}")[0][0].as_py()
    report.lost_rows += max(0, initial - kept)  # rows from before the drill
    report.duplicated_rows += max(0, kept - initial)
    return report


def play_nemesis(
    db: Database,
    local: LocalRayCluster,
    kinds: list[str] | tuple[str, ...],
    faults: int,
    seed: int,
    report: DrillReport,
    settle_s: float,
    overlap: float = OVERLAP_SHARE,
) -> None:
    """Play ``faults`` faults, one after another, each of a kind drawn from ``kinds`` with
    ``seed``, a share ``overlap`` of them while another data node is paused as well: each is
    printed with the seconds until every shard answered again."""
    unknown = sorted(set(kinds) - set(NEMESIS_KINDS))
    if unknown or not kinds:
        raise ValueError(f"nemesis kinds are {', '.join(NEMESIS_KINDS)}, not {unknown or kinds}")
    if HEAD in kinds and local.ha is None:
        raise ValueError("the head fault needs a cluster that survives it (cluster up --ha)")
    if FLAKY in kinds and not db.settings.test_flaky_node.startswith(f"{FLAKY_NODE}="):
        raise ValueError(
            f"the flaky fault needs the service started with test_flaky_node="
            f'"{FLAKY_NODE}=SHARE" (bench/nemesis.py starts it so)'
        )
    rng = random.Random(seed)
    overlaps = random.Random(seed + 1)  # apart: the faults themselves are drawn as before
    driver = attached_node()  # never the node this drill's own driver rides on
    schedule = [rng.choice(sorted(kinds)) for _ in range(faults)]  # then the victims
    for index, kind in enumerate(schedule):
        victims = [n for n in local.nodes() if not n.head and n.node_id != driver]
        also = None
        if kind != "pause" and overlaps.random() < overlap:
            also = overlaps.choice(victims)
            threading.Thread(target=pause, args=(also.pid, PAUSE_S), daemon=True).start()
        started = time.monotonic()
        if kind == HEAD:
            target, _ = kill(db, local, HEAD)
            recovery = wait_served(db, "", started)
        elif kind == FLAKY:
            target = FLAKY_NODE
            recovery = flaky_node(db, local, report)
        elif kind == PARTITION:
            target, recovery = partition(db, local, rng, report)
        elif kind == DISK:
            target, recovery = "data-dir", disk_full(local, report)
        elif kind == "kill":
            node = rng.choice(victims)
            target, ray_node = kill(db, local, node.name)
            report.lost.append(target)
            recovery = wait_served(db, ray_node, started)
            rejoin(db, local, None, report)  # as many nodes as before: a new one joins
        else:
            node = rng.choice(victims)
            target = node.name
            pause(node.pid, PAUSE_S)
            recovery = wait_served(db, "", started)
        if also is not None:
            target += f" (and {also.name} paused)"
        report.faults.append(f"{kind} {target}")
        report.fault_recovery_s.append(recovery)
        print(f"fault {index + 1}/{faults}: {kind} {target}: served again after "
              f"{recovery:.2f}s", flush=True)  # fmt: skip
        time.sleep(settle_s)


def possible_faults(db: Database, local: LocalRayCluster) -> list[str]:
    """The nemesis's kinds this cluster can take: the head's loss where it survives it, a
    flaky node where the service knows the flaky node's name."""
    kinds = ["kill", "pause"]
    if local.ha is not None:
        kinds.append(HEAD)
    if db.settings.test_flaky_node.startswith(f"{FLAKY_NODE}="):
        kinds.append(FLAKY)
    if local.network is not None:
        kinds.append(PARTITION)
    if small_disk(local.data_dir):
        kinds.append(DISK)
    return kinds


def small_disk(folder: str) -> bool:
    """Whether ``folder`` is on a filesystem small enough to fill (:data:`SMALL_DISK_BYTES`)."""
    found = os.statvfs(folder)
    return found.f_blocks * found.f_frsize <= SMALL_DISK_BYTES


def disk_full(local: LocalRayCluster, report: DrillReport) -> float:
    """Fill the data directory's filesystem for :data:`DISK_FULL_S`, then make room again;
    returns the seconds from then until an insert landed again."""
    if not small_disk(local.data_dir):
        raise ValueError(
            "the disk fault fills the data directory's filesystem: put the data directory "
            f"on one of at most {SMALL_DISK_BYTES >> 20} MiB (a tmpfs of fixed size)"
        )
    balloon = os.path.join(local.data_dir, BALLOON)
    try:
        with open(balloon, "wb", buffering=0) as out:  # each write reaches the disk
            for size in (1 << 20, 1 << 12, 1):  # to the last byte
                chunk = b"\0" * size
                with contextlib.suppress(OSError):
                    while True:
                        out.write(chunk)
                        out.flush()
        refused = report.refused_inserts
        deadline = time.monotonic() + DISK_FULL_S
        while time.monotonic() < deadline:  # the inserts meet the full disk meanwhile
            time.sleep(0.05)
        if report.refused_inserts == refused:
            report.failures.append("disk: no insert was refused while the disk was full")
    finally:
        os.unlink(balloon)
    healed, landed = time.monotonic(), report.inserts
    while report.inserts == landed:
        if time.monotonic() > healed + RECOVERY_TIMEOUT_S:
            raise TimeoutError(f"no insert landed {RECOVERY_TIMEOUT_S:g}s after the disk had room")
        time.sleep(0.02)
    return time.monotonic() - healed


def partition(
    db: Database, local: LocalRayCluster, rng: random.Random, report: DrillReport
) -> tuple[str, float]:
    """Cut the network (a cut of :data:`CUTS`, drawn with ``rng``) around a data node that
    neither runs the coordinator nor this driver, for a while, then heal it; returns what
    was cut and the seconds until every shard answered again: from the cut for a node cut
    off (its shards are failed over meanwhile), from the heal for the client's cuts (its
    calls to that node wait until then)."""
    network = local.network
    if network is None:
        raise ValueError("the partition fault needs a cluster in network namespaces")
    host = db.cluster.coordinator_host()
    names = {n.node_id: n.name for n in local.nodes()}
    cut = rng.choice(sorted(CUTS))
    victims = [n for n in local.nodes() if not n.head and n.node_id not in (host, attached_node())]
    node = rng.choice(victims)
    started = time.monotonic()
    if cut == "node":
        network.cut(node.name, HEAD)
        network.cut(node.name, names[host])
    elif cut == "client":
        network.cut(CLIENT, node.name)
    else:
        network.cut(node.name, CLIENT, one_way=True)
    try:
        if cut == "node":
            recovery = wait_served(db, node.node_id, started)
        time.sleep(max(0.0, started + CUTS[cut] - time.monotonic()))
    finally:
        network.heal()
    if cut == "node":
        report.lost.append(node.name)
        _replace_cut_off(db, local, node, report)
    else:
        recovery = wait_served(db, "", time.monotonic())
    return f"{cut} {node.name}", recovery


def _replace_cut_off(
    db: Database, local: LocalRayCluster, node: LocalNode, report: DrillReport
) -> None:
    """A node declared dead while cut off ends once it hears so from the head (its
    raylet exits): wait for that (or stop it), and let a new node join in its place."""
    deadline = time.monotonic() + NODE_END_WAIT_S
    while node.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    local.remove_node(node.name, kill=True)
    rejoin(db, local, None, report)


def flaky_node(db: Database, local: LocalRayCluster, report: DrillReport) -> float:
    """A Ray node whose worker fails a share of its fragments joins; returns the seconds
    from its first shard until it was found suspect and held none (its shards moved off
    live), then it is stopped."""
    rejoin(db, local, FLAKY_NODE, report)
    member = report.joined[-1]
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    try:
        # small tables give a new node no shard by themselves: it is given two the
        # workload reads, as the balancer gives a new node its share of big ones
        for shard in [s for s in db.cluster.shards().to_pylist() if s["table"] == EVENTS][:2]:
            with contextlib.suppress(MoveRefusedError):  # refused or rolled back: one fewer
                db.cluster.migrate(str(shard["shard"]), member)
        first_shard = time.monotonic()
        while time.monotonic() < deadline:
            info = next((n for n in db.cluster.nodes() if n.node_id == member), None)
            if info is not None and not info.shards and info.health != "healthy":
                return time.monotonic() - first_shard
            time.sleep(0.1)
        raise TimeoutError(f"{member} on {FLAKY_NODE} was not evacuated within "
                           f"{RECOVERY_TIMEOUT_S:g}s")  # fmt: skip
    finally:
        local.remove_node(FLAKY_NODE)


def pause(pid: int, seconds: float) -> None:
    """SIGSTOP a node (its process and every process below it) for ``seconds``."""
    pids = [pid, *descendants(pid)]
    for target in pids:
        _signal(target, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for target in pids:
            _signal(target, signal.SIGCONT)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--moves", type=int, default=20)
    parser.add_argument("--grow", type=int, default=0, help="Ray nodes to add first")
    parser.add_argument("--drain", action="append", default=[], help="a Ray node to drain")
    parser.add_argument(
        "--kill",
        action="append",
        default=[],
        help=f"ray-N, coordinator, {MID_MOVE}, {RESULTS} or {HEAD} (a cluster up with --ha)",
    )
    parser.add_argument("--rejoin", action="append", default=[], help=f"a Ray node name, or {LOST}")
    parser.add_argument(
        "--nemesis",
        default="",
        help=f"the kinds of fault the nemesis plays, comma-separated ({', '.join(NEMESIS_KINDS)}); "
        "default: every kind the cluster can take",
    )
    parser.add_argument("--faults", type=int, default=0, help="faults the nemesis plays")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the nemesis")
    parser.add_argument(
        "--overlap",
        type=float,
        default=OVERLAP_SHARE,
        help="the share of faults during which another data node is paused too",
    )
    parser.add_argument(
        "--drop-tables", action="store_true", help="drop the drill's tables when it is done"
    )
    args = parser.parse_args(argv)
    local = LocalRayCluster(args.data_dir)
    # the drill's tables are small: spread them anyway, so every node has shards to lose;
    # its moves go back to back (migration_share 1.0): the churn is what it checks
    db = connect(
        address=args.address, data_dir=args.data_dir, initial_shard_bytes=0, migration_share=1.0
    )
    assert isinstance(db, Database)  # a Ray address: never a remote service
    with db:
        report = run_drill(
            db,
            local,
            rows=args.rows,
            moves=args.moves,
            grow=args.grow,
            drains=args.drain,
            kills=args.kill,
            rejoins=args.rejoin,
            nemesis=[k for k in args.nemesis.split(",") if k] or possible_faults(db, local),
            faults=args.faults,
            seed=args.seed,
            overlap=args.overlap,
        )
        if args.drop_tables:
            for name in TABLES:
                db.drop_table(name)
    print("RESULT " + json.dumps(asdict(report)), flush=True)
    print(report.line(), flush=True)
    if args.drop_tables:
        print(f"dropped the drill's tables ({', '.join(TABLES)})", flush=True)
    else:
        print(
            f"the drill's tables ({', '.join(TABLES)}) stay in {args.data_dir} for the next "
            "drill: --drop-tables drops them when it is done, `shardflow drop NAME` later",
            flush=True,
        )
    if args.faults:  # the nemesis's line, last
        print(report.nemesis_line(), flush=True)


if __name__ == "__main__":
    main()
