"""Prometheus metrics, read from live state at scrape time.

The coordinator serves them. Counters and histograms of events (queries, inserts, moves) are
kept in :class:`Recorder`; gauges of the cluster's state (nodes, shards, memory) come from a
snapshot function called at every scrape, so they are never stale.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NAMESPACE = "shardflow"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MOVE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
QPS_WINDOW_S = 10
"""The window of the queries-per-second figure the console shows: long enough that a few
slow queries do not make it flicker, short enough to follow a load change."""


def name(metric: str) -> str:
    return f"{NAMESPACE}_{metric}"


@dataclass
class NodeGauges:
    node: str
    utilization: float
    """Busy fraction of execution time over the last window."""
    device_utilization: float | None
    device_memory_used_bytes: int | None
    device_memory_free_bytes: int | None
    memory_used_bytes: int
    memory_free_bytes: int
    queries_running: int
    shards: int
    bytes: int
    capacity: float
    failure_rate: float = 0.0
    """Share of its operations failed over the failure window."""
    engine_memory_bytes: int = 0
    spilled_bytes: int = 0
    memory_limit_bytes: int = 0
    suspect: bool = False
    device_cache_bytes: int | None = None
    device_cache_hit_rate: float | None = None
    """Suspect or failing: it gets no new shards and its shards move off."""


@dataclass
class ClusterGauges:
    nodes: list[NodeGauges] = field(default_factory=list)
    failovers: int = 0
    decisions: Mapping[str, int] = field(default_factory=dict)
    """Balancer decisions by whether they acted."""


class RateWindow:
    """Events per second over the last ``window_s`` whole seconds, counted in one-second
    slots (so memory stays bounded whatever the rate); also the total since the start.

    >>> clock = iter([100.2, 100.7, 101.5, 101.9]).__next__
    >>> window = RateWindow(2, clock)
    >>> window.add(); window.add(); window.add()
    >>> window.rate(), window.total  # 3 events in the 2 seconds 100 and 101
    (1.5, 3)
    """

    def __init__(self, window_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.total = 0
        self._clock = clock
        self._slots: deque[list[int]] = deque()
        """[second, events] per second that saw events, oldest first."""
        self._lock = threading.Lock()

    def add(self, count: int = 1) -> None:
        second = int(self._clock())
        with self._lock:
            self.total += count
            if self._slots and self._slots[-1][0] == second:
                self._slots[-1][1] += count
            else:
                self._slots.append([second, count])
            self._trim(second)

    def rate(self) -> float:
        second = int(self._clock())
        with self._lock:
            self._trim(second)
            return sum(count for _, count in self._slots) / self.window_s

    def _trim(self, second: int) -> None:
        while self._slots and self._slots[0][0] <= second - self.window_s:
            self._slots.popleft()


class Recorder:
    """Event metrics: what happened, counted as it happens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter(name("queries"), "Queries run", registry=registry)
        self.failed = Counter(name("queries_failed"), "Queries that failed", registry=registry)
        self.latency = Histogram(
            name("query_seconds"), "Query latency", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.inserts = Counter(name("inserts"), "Insert calls", registry=registry)
        self.insert_rows = Counter(name("insert_rows"), "Rows inserted", registry=registry)
        self.moves = Counter(
            name("migrations"),
            "Live moves by kind and outcome",
            ["kind", "outcome"],
            registry=registry,
        )
        self.move_seconds = Histogram(
            name("migration_seconds"),
            "Duration of live moves",
            buckets=MOVE_BUCKETS,
            registry=registry,
        )
        self.phase_seconds = Histogram(
            name("migration_phase_seconds"),
            "Time spent per phase of live moves",
            ["phase"],
            buckets=MOVE_BUCKETS,
            registry=registry,
        )
        self.fence = Histogram(
            name("fence_seconds"),
            "Write-fence pause of live moves",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.auth_failures = Counter(
            name("auth_failures"),
            "Flight calls refused for a wrong password or an unknown or expired token",
            registry=registry,
        )
        self.denied = Counter(
            name("denied"),
            "Flight calls refused because the caller's role does not allow them",
            ["action"],
            registry=registry,
        )
        self.query_rate = RateWindow(QPS_WINDOW_S)
        """Queries per second over the last few seconds (the console's QPS)."""
        self._lock = threading.Lock()

    def access(self, denied_action: str | None) -> None:
        """A refused service call: an authentication failure, or a denied ``action``."""
        if denied_action is None:
            self.auth_failures.inc()
        else:
            self.denied.labels(denied_action).inc()

    def query(self, seconds: float, ok: bool) -> None:
        self.queries.inc()
        self.query_rate.add()
        if not ok:
            self.failed.inc()
        self.latency.observe(seconds)

    def insert(self, rows: int) -> None:
        self.inserts.inc()
        self.insert_rows.inc(rows)

    def move(self, record: Mapping[str, Any]) -> None:
        outcome = "done" if record["phase"] == "done" else "rolled_back"
        if str(record.get("outcome", "")).startswith("cancelled"):
            outcome = "cancelled"
        self.moves.labels(record["kind"], outcome).inc()
        self.move_seconds.observe(record["seconds"])
        for phase, seconds in record["phase_seconds"].items():
            self.phase_seconds.labels(phase).observe(seconds)
        self.fence.observe(record["fence_seconds"])


class ClusterCollector(Collector):
    """Gauges of the cluster's state, taken from ``snapshot()`` at every scrape."""

    def __init__(self, snapshot: Callable[[], ClusterGauges]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        state = self._snapshot()
        per_node = {
            "node_utilization": ("Busy fraction of execution time", "utilization"),
            "node_device_utilization": (
                "GPU utilisation from NVML / AMD SMI",
                "device_utilization",
            ),
            "node_device_memory_used_bytes": (
                "GPU memory used, from NVML / AMD SMI",
                "device_memory_used_bytes",
            ),
            "node_device_memory_free_bytes": (
                "GPU memory free, from NVML / AMD SMI",
                "device_memory_free_bytes",
            ),
            "node_memory_used_bytes": ("Memory used by the worker", "memory_used_bytes"),
            "node_memory_free_bytes": ("Memory free on the worker's machine", "memory_free_bytes"),
            "node_engine_memory_bytes": (
                "Memory the worker's DuckDB holds (shards, and queries' state)",
                "engine_memory_bytes",
            ),
            "node_spilled_bytes": (
                "Bytes the worker's DuckDB has spilled to local_dir",
                "spilled_bytes",
            ),
            "node_memory_limit_bytes": (
                "Memory the worker's DuckDB may use (worker_memory_mb)",
                "memory_limit_bytes",
            ),
            "node_queries_running": ("Fragments running now", "queries_running"),
            "node_shards": ("Shards served", "shards"),
            "node_bytes": ("Bytes of shard data served", "bytes"),
            "node_capacity": ("Calibrated capacity relative to the median node", "capacity"),
            "node_failure_rate": (
                "Share of the node's operations that failed over node_failure_window_s",
                "failure_rate",
            ),
            "node_suspect": ("1 while the node is suspect or failing (being evacuated)", "suspect"),
            "node_device_cache_bytes": (
                "Shard frames kept in the engine's memory (the GPU's; device_cache_mb)",
                "device_cache_bytes",
            ),
            "node_device_cache_hit_ratio": (
                "Of the fragments' shard reads, those that found the shard kept",
                "device_cache_hit_rate",
            ),
        }
        for metric, (help_text, attribute) in per_node.items():
            family = GaugeMetricFamily(name(metric), help_text, labels=["node"])
            for node in state.nodes:
                value = getattr(node, attribute)
                if value is not None:
                    family.add_metric([node.node], float(value))
            yield family
        nodes = GaugeMetricFamily(name("nodes"), "Live worker nodes")
        nodes.add_metric([], float(len(state.nodes)))
        yield nodes
        failovers = CounterMetricFamily(name("failovers"), "Workers declared dead")
        failovers.add_metric([], float(state.failovers))
        yield failovers
        decisions = CounterMetricFamily(
            name("balancer_decisions"), "Balancer decisions", labels=["acted"]
        )
        for acted, count in state.decisions.items():
            decisions.add_metric([acted], float(count))
        yield decisions


def registry_for(snapshot: Callable[[], ClusterGauges]) -> tuple[CollectorRegistry, Recorder]:
    registry = CollectorRegistry()
    recorder = Recorder(registry)
    registry.register(ClusterCollector(snapshot))
    return registry, recorder
