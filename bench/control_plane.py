"""The control plane at scale: catalogs of 100 to 10,000 nodes and 10k to 1M units, a
balancing day of moves, splits and table creations through the real catalog code — the
coordinator's state persisting its changes to a real directory (``catalog/store.py``), the
real announcer (``runtime/coordinator/announce.py``) telling in-process workers, which take
the changes as a worker does (``catalog/delta.py``) — and how bytes written, bytes sent,
coordinator and worker CPU per change and restart time grow. Beside each figure, what the
whole-catalog versions and announcements before cost at that size. The last line is
``move_bytes_written=A move_bytes_sent=B worker_cpu_ms_per_change=C restart_s_1m_units=D``
at 1,000 nodes and 1M units (B with the nodes a move touched, two).

    python bench/control_plane.py                  # the four sizes, 200 changes each
    python bench/control_plane.py --sizes 100:10000:1000 --changes 50
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pyarrow as pa

from shardflow.catalog import Catalog, CatalogStore, DataDir, Group, TableSpec, Unit, delta
from shardflow.catalog.buckets import key_family, split_range
from shardflow.catalog.model import collector_paused
from shardflow.config import MAX_BUCKETS, Settings
from shardflow.runtime.coordinator.announce import Announcer
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.protocol import NewTable

SCHEMA = pa.schema([("id", pa.int64()), ("amount", pa.float64()), ("note", pa.string())])
SIZES = ("100:10000:1000", "1000:100000:10000", "1000:1000000:10000", "10000:1000000:10000")
"""nodes:units:tables."""
HEADLINE = "1000:1000000:10000"


class Answer:
    """A reply that is here already (in-process workers answer at once)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def get(self, timeout: float | None = None) -> int:
        return self.value


@dataclass
class Worker:
    """What a worker does with the catalog: keep its view, take changes to it, and find
    the shards they give or take (``WorkerNode.follow``/``sync``, without the shards)."""

    node: str
    catalog: Catalog
    cpu_s: list[float] = field(default_factory=list)

    def follow(self, changes: Sequence[Mapping[str, Any]]) -> Answer:
        # workers with the same catalog told the same changes (a table created, told to
        # every node) reach the same catalog: made once, its CPU counted for each, so that
        # 10,000 workers do not hold 10,000 copies in this one process
        key = (id(self.catalog), json.dumps(changes, sort_keys=True))
        found = SHARED.get(key)
        if found is not None and found[0] is self.catalog:
            self.catalog = found[1]
            self.cpu_s.append(found[2])
            return Answer(self.catalog.version)
        before = self.catalog
        answer = self._follow(changes)
        if answer.value >= 0:
            SHARED[key] = (before, self.catalog, self.cpu_s[-1])
        return answer

    def _follow(self, changes: Sequence[Mapping[str, Any]]) -> Answer:
        # the collector paused: this one process holds every worker's catalog, and a pass
        # over all of them would land on whichever worker allocated last (measured apart)
        with collector_paused():
            started = time.thread_time()
            try:
                catalog, applied = delta.follow(self.catalog, changes)
            except delta.ChangeError:
                return Answer(-1)
            delta.shards_touched(catalog, applied)
            self.catalog = catalog
            self.cpu_s.append(time.thread_time() - started)
        return Answer(catalog.version)

    def sync(self, whole: Mapping[str, Any]) -> Answer:
        started = time.thread_time()
        catalog = Catalog.from_json(json.loads(json.dumps(whole)))  # as it arrives: bytes
        catalog.shards_on(self.node)
        self.catalog = catalog
        self.cpu_s.append(time.thread_time() - started)
        return Answer(catalog.version)


SHARED: dict[tuple[int, str], tuple[Catalog, Catalog, float]] = {}
"""Catalogs made by a worker's change, by the catalog it had and the change (one change)."""


class Workers:
    def __init__(self, workers: dict[str, Worker]) -> None:
        self.workers = workers

    def get(self, node: str) -> Worker:
        return self.workers[node]


def build(nodes: int, units: int, tables: int) -> Catalog:
    """A catalog of ``tables`` tables, each its own group, ``units`` units in all spread
    round-robin over ``nodes`` nodes (built at once: table by table would copy the groups
    ``tables`` times)."""
    per_table = max(units // tables, 1)
    buckets = MAX_BUCKETS  # the default: fine-grained from the start, nothing kept per bucket
    names = [f"node-{i}" for i in range(nodes)]
    groups: dict[str, Group] = {}
    specs: dict[str, TableSpec] = {}
    unit_id = 0
    for t in range(tables):
        group_id = f"g{t:08x}"
        ranges = split_range(0, buckets, per_table)
        group_units = tuple(
            Unit(unit_id + i, lo, hi, names[(unit_id + i) % nodes])
            for i, (lo, hi) in enumerate(ranges)
        )
        unit_id += per_table
        groups[group_id] = Group(group_id, key_family(pa.int64()), group_units)
        name = f"t{t}"
        specs[name] = TableSpec(name, uuid.uuid4().hex, SCHEMA, "distributed", "id", group_id)
    return Catalog(
        version=1,
        n_buckets=buckets,
        nodes=tuple(names),
        tables=MappingProxyType(specs),
        groups=MappingProxyType(groups),
        next_unit_id=unit_id,
        next_node_index=nodes,
    )


@dataclass
class Change:
    kind: str
    written: int
    sent: int
    told: int
    coordinator_s: float
    worker_s: list[float]


def day(
    state: CoordinatorState, announcer: Announcer, workers: Workers, count: int
) -> list[Change]:
    """``count`` changes: 80 % moves, 15 % splits, 5 % table creations."""
    rng = random.Random(7)
    nodes = list(state.catalog.nodes)
    done: list[Change] = []
    for index in range(count):
        SHARED.clear()
        roll = rng.random()
        written, sent = state.store.written, announcer.bytes_sent
        marks = {n: len(w.cpu_s) for n, w in workers.workers.items()}
        started = time.thread_time()
        if roll < 0.05:
            kind = "create"
            told = create_table(state, announcer, index)
        else:
            group = rng.choice(list(state.catalog.groups.values()))
            unit = rng.choice(group.units)
            if roll < 0.20 and unit.buckets > 1:
                kind, plan = "split", state.plan_split(unit.unit_id)
            else:
                to = rng.choice([n for n in nodes if n != unit.node])
                kind, plan = "move", state.plan_move(unit.unit_id, to)
            state.apply_switch(plan)
            state.finish_move(plan)
            announcer.announce(plan.nodes)
            told = len(plan.nodes)
        worker_s = [
            sum(w.cpu_s[marks[n] :]) for n, w in workers.workers.items() if len(w.cpu_s) > marks[n]
        ]
        coordinator_s = time.thread_time() - started - sum(worker_s)
        done.append(
            Change(
                kind,
                state.store.written - written,
                announcer.bytes_sent - sent,
                told,
                coordinator_s,
                worker_s,
            )
        )
    return done


def create_table(state: CoordinatorState, announcer: Announcer, index: int) -> int:
    """A table created as a session does it: planned, committed, and every node told the
    change (``Coordinator.announce``); answers the nodes told."""
    schema = SCHEMA.serialize().to_pybytes()
    state.begin_create(NewTable(f"new{index}", schema, "distributed", "id", size_bytes=1 << 30))
    state.commit_create(f"new{index}", 0)
    announcer.announce(state.catalog.nodes)
    return len(state.catalog.nodes)


SESSION_TABLES = 3


def session_refresh(state: CoordinatorState) -> tuple[float, int]:
    """What a session that uses ``SESSION_TABLES`` tables fetches when a ``Moved`` makes it
    refresh its routing (``Session.refresh``): the coordinator's seconds and the bytes."""
    tables = sorted(state.catalog.tables)[:SESSION_TABLES]
    started = time.thread_time()
    routing = state.catalog_json(tables)
    took = time.thread_time() - started
    assert sorted(spec["name"] for spec in routing["tables"]) == tables
    return took, len(json.dumps(routing))


def run_size(nodes: int, units: int, tables: int, count: int) -> dict[str, float]:
    started = time.perf_counter()
    catalog = build(nodes, units, tables)
    built_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="shardflow-control-") as folder:
        data_dir = DataDir.resolve(folder)
        started = time.perf_counter()
        CatalogStore(data_dir).save(catalog)
        snapshot_s = time.perf_counter() - started
        whole_bytes = sum(
            p.stat().st_size for p in (Path(folder) / "catalog").iterdir() if p.is_file()
        )
        started = time.perf_counter()
        state = CoordinatorState(folder, Settings(lease_ttl_s=3600))
        first_load_s = time.perf_counter() - started
        workers = Workers({n: Worker(n, state.catalog) for n in state.catalog.nodes})
        announcer = Announcer(state, workers, timeout_s=30, measure=True)
        for node in state.catalog.nodes:
            announcer.served(node, state.catalog.version)
        changes = day(state, announcer, workers, count)
        session_s, session_bytes = session_refresh(state)
        state.store.flush()
        started = time.perf_counter()
        restarted = CatalogStore(data_dir).load()
        restart_s = time.perf_counter() - started
        assert restarted == state.catalog, "the catalog read back differs"
        told = [w for w in workers.workers.values() if w.cpu_s]
        for worker in random.Random(3).sample(told, min(len(told), 40)):
            mine = set(worker.catalog.shards_on(worker.node))
            assert mine == set(state.catalog.shards_on(worker.node)), worker.node
        state.release_lease()
    del workers, announcer, state, restarted
    gc.collect()
    started = time.perf_counter()
    gc.collect()  # a worker's own pass over its catalog (only ``catalog`` is alive now)
    collect_s = time.perf_counter() - started
    moves = [c for c in changes if c.kind == "move"]
    splits = [c for c in changes if c.kind == "split"]
    creates = [c for c in changes if c.kind == "create"]
    worker_ms = [s * 1000 for c in moves + splits for s in c.worker_s]
    figures = {
        "nodes": nodes,
        "units": units,
        "tables": tables,
        "whole_bytes": whole_bytes,
        "move_written": statistics.median(c.written for c in moves),
        "move_sent": statistics.median(c.sent for c in moves),
        "move_told": statistics.median(c.told for c in moves),
        "split_written": statistics.median(c.written for c in splits) if splits else 0,
        "split_sent": statistics.median(c.sent for c in splits) if splits else 0,
        "create_written": statistics.median(c.written for c in creates) if creates else 0,
        "create_sent": statistics.median(c.sent for c in creates) if creates else 0,
        "coordinator_ms": statistics.median(c.coordinator_s * 1000 for c in moves + splits),
        "worker_ms": statistics.median(worker_ms),
        "worker_ms_max": max(worker_ms),
        "create_worker_ms": (
            statistics.median(s * 1000 for c in creates for s in c.worker_s) if creates else 0
        ),
        "session_bytes": session_bytes,
        "session_ms": session_s * 1000,
        "restart_s": restart_s,
        "collect_s": collect_s,
        "first_load_s": first_load_s,
        "snapshot_s": snapshot_s,
        "built_s": built_s,
    }
    print(
        f"{nodes} nodes, {units} units, {tables} tables: whole catalog {whole_bytes / 1e6:.1f} MB"
        f" (written in {snapshot_s:.2f} s, read in {first_load_s:.2f} s)\n"
        f"  a move: {figures['move_written']:.0f} bytes written, "
        f"{figures['move_sent']:.0f} bytes sent to {figures['move_told']:.0f} nodes "
        f"(whole versions: {whole_bytes / 1e6:.1f} MB written, "
        f"{whole_bytes * nodes / 1e9:.2f} GB sent); a split: "
        f"{figures['split_written']:.0f} written, {figures['split_sent']:.0f} sent; a table "
        f"created: {figures['create_written'] / 1e3:.1f} KB written, "
        f"{figures['create_sent'] / 1e3:.0f} KB sent to {nodes} nodes\n"
        f"  CPU per move or split: coordinator {figures['coordinator_ms']:.1f} ms, a worker "
        f"told {figures['worker_ms']:.2f} ms (max {figures['worker_ms_max']:.2f}); a table "
        f"created: {figures['create_worker_ms']:.2f} ms a worker\n"
        f"  a session's refresh of the {SESSION_TABLES} tables it uses: "
        f"{session_bytes / 1e3:.1f} KB in {session_s * 1000:.2f} ms of the coordinator "
        f"(the catalog whole: {whole_bytes / 1e6:.1f} MB)\n"
        f"  restart after the day: {restart_s:.2f} s (the snapshot and {len(changes)} changes); "
        f"a pass of Python's cyclic collector over the catalog {collect_s * 1000:.0f} ms",
        flush=True,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help="nodes:units:tables")
    parser.add_argument("--changes", type=int, default=200, help="changes in the day")
    args = parser.parse_args()
    results = {}
    for size in args.sizes:
        nodes, units, tables = (int(part) for part in size.split(":"))
        results[size] = run_size(nodes, units, tables, args.changes)
    headline = results.get(HEADLINE) or results[args.sizes[-1]]
    print(
        f"move_bytes_written={headline['move_written']:.0f} "
        f"move_bytes_sent={headline['move_sent']:.0f} "
        f"worker_cpu_ms_per_change={headline['worker_ms']:.2f} "
        f"restart_s_1m_units={headline['restart_s']:.2f}"
    )


if __name__ == "__main__":
    main()
