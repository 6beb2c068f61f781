"""Settings: every knob shardflow has, with its default and what it does."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from shardflow.errors import ConfigError

ENGINES = ("auto", "duckdb", "polars")
FLIGHT_ENDPOINTS = ("service", "workers")
MAX_PORT = 65535
MOVE_COPY_FAULTS = ("", "drop_row", "change_value")
RESIDENT_FAULTS = ("", "skip_append")


MIN_WORKER_MEMORY_MB = 16
"""Below this DuckDB cannot hold even one block per thread."""
MAX_BUCKETS = 1 << 30
"""The most virtual buckets, and the default: a bucket and a range's end fit an int32."""


@dataclass(frozen=True)
class Settings:
    """Cluster and session settings. Pass to ``connect(settings=...)`` or as keywords.

    Attributes:
        buckets: virtual buckets a distribution key hashes into. Fixed for the life of a data
            directory; a shard owns a contiguous range of them, so this bounds how finely a
            table can ever be split. The default (and most), 2^30, is fine-grained from the
            start: a petabyte table's buckets hold about a megabyte each, and nothing is
            kept per bucket (units are ranges, a batch's retry record is a range).
        shards_per_worker: shards a new distributed table gets per worker at creation
            (more give finer moves from the start, and cost every query over the table a
            UNION of the worker's shards; the balancer splits what grows too big or hot);
            but no more than its source fills at ``initial_shard_bytes`` each.
        engine_threads: DuckDB threads per worker; 0 means the node's cores divided among
            the workers of an embedded cluster, and all of the node's cores otherwise.
        worker_memory_mb: memory each worker's DuckDB may use for its shards and its
            queries, in MiB; beyond it table blocks and big operators' state spill to
            ``local_dir``, and a query that cannot fit fails with ``QueryError`` naming this
            setting. 0 means the node's share: 75 % of the machine's memory divided among
            the workers of an embedded cluster, 75 % of it for a worker of a Ray node.
        local_dir: a folder on each worker's local disk where its DuckDB spills (a
            folder per worker process, removed when it stops; the durable copy of every
            shard stays in the data directory). Empty: ``shardflow-local`` in the system's
            temporary directory.
        retry_deadline_s: how long a query or insert keeps retrying fragments whose worker
            died or moved before it gives up with ``ClusterError``.
        load_batch_rows: rows read and routed at a time when a table is loaded.
        wal_checkpoint_entries: write-ahead log entries a shard keeps before folding them
            into a new Parquet base.
        wal_checkpoint_bytes: log bytes a shard keeps before a checkpoint.
        plan_cache_size: distributed plans a session keeps per catalog's tables (moves,
            splits and merges keep them), by shape
            (queries differing only in compared constants share one) and by query text.
        fast_lane: a query part whose result comes back to the session and whose inputs,
            if any, the session holds (a point lookup on the distribution key, partials the
            session merges, a later stage reading a merged subquery) goes to each worker
            over a TCP connection the session keeps open to it, not through a Ray actor
            call; off: every part through Ray.
        stream_buffer_mb: the most MiB of an answer read as it arrives (``db.stream``, the
            Flight SQL service's answers) that wait in the session for the reader; the
            parts still to read wait on the workers. An answer that must be finished in
            one place first (a merge, ORDER BY, LIMIT) is held whole instead.
        object_store_memory: bytes for Ray's object store when ``connect`` starts Ray;
            0 lets Ray choose (30 % of memory).
        migration_bandwidth_mb_s: cap on the copy rate of one live move, in MB/s; 0 means
            as fast as the transport goes. A split or a merge copies rows; a plain move
            opens the unit's checkpoint file where it lies and copies nothing (where the
            data directory is not a local folder it copies the file first, uncapped).
        migration_share: the share of the time live moves (splits, merges, migrations) may
            take while queries or inserts run: a move waits until the one before it fits
            (after a move of 0.3 s, the next starts 2.7 s later at 0.1). Moves on a cluster
            nobody uses, and a drain's moves, never wait; 1.0 turns the pacing off.
        health_interval_s: how often the coordinator pings every worker.
        health_misses: unanswered pings in a row after which a worker is declared dead and
            its shards are reassigned (a worker whose process died is declared at once).
        auto_join: on a cluster joined by address (``connect(address=...)``, ``shardflow
            serve``, ``shardflow cluster up``): a Ray node that joins the Ray cluster gets a
            worker of its own (one per GPU on a GPU node) and, through the balancer, its share
            of the shards. A Ray node that dies is failed over either way; one removed with
            ``shardflow cluster remove-node`` is drained first. Off: only ``add_node`` adds
            workers.
        auto_balance: whether the coordinator rebalances by itself every balance interval.
        balance_hours: the hours of the day (UTC) in which the balancer may start moves by
            itself, e.g. ``"22-6"`` (22:00 to 05:59) or ``"0-5,13"``; empty (the default):
            any hour. A suspect node is evacuated at any hour; ``db.cluster.rebalance()``
            and ``pause_balancer()`` are not held to it.
        balance_interval_s: how often the coordinator reads load and sizes and decides.
        utilization_threshold: a node busier than this (busy fraction of execution time over
            the last interval) sheds load.
        balance_tolerance: how far a node's load per unit of capacity may deviate from the
            mean before shards move (0.10 = 10 %).
        load_swing: a change of total cluster load between two polls larger than this
            (0.20 = 20 %) triggers a re-plan.
        predictive_balancing: once every shard unit has a day of load history, balance on
            forecasts (``control/forecast.py``): keep every node under
            ``utilization_threshold`` at every hour of the coming period, moving ahead of
            forecast peaks in quiet hours, rather than chase each window's spread.
        forecast_period_s: the season of the load forecast (a day); each unit's history is
            one smoothed number per slot of it, kept in the data directory
            (``balancer/load_history.json``).
        forecast_slots: the slots a forecast period is cut into (48: half-hours).
        max_concurrent_moves: live moves (splits, merges, migrations) in flight at once.
        max_shard_bytes: a shard unit larger than this is split (1 TiB; MiB in tests).
        min_shard_bytes: adjacent cold units smaller than this together are merged; the target
            size of a unit lies between the two, smaller for units whose queries cost more per
            byte.
        initial_shard_bytes: a new distributed table loaded from a source whose size is
            known before the load (a ``pyarrow.Table``; Parquet, estimated from its first
            batch; in Arrow bytes) gets at most one shard per this many bytes, and at least
            one: every shard costs each query over the table a fragment's fixed cost
            (planning it, sending it, merging its answer), which for a small table outweighs
            the scan the shards share (TPC-H SF 0.1 on 4 workers ran 1.5-1.8x DuckDB with
            lineitem in one shard, 2.2-2.6x in four). A stream, whose size is unknown, and an
            empty table get ``shards_per_worker`` a worker; so does every table with 0. A
            co-located table shares the shards of the table it is co-located with.
        metrics_port: port of the coordinator's Prometheus endpoint and read-only console
            page on 127.0.0.1; 0 picks a free port (``db.cluster.metrics_url()`` says which).
        profile_queries: keep the per-fragment timings that ``db.profile()`` and
            ``db.last_report`` show (on by default: it costs under 2 %).
        lease_ttl_s: how long the data directory's owner lease lasts without renewal (the
            coordinator renews it every quarter of that). Another cluster may take the data
            directory over once it expired — at once if the owner ran on this machine and
            exited — and this cluster's writes are refused from then on.
        token_ttl_s: how long a bearer token from the password handshake of the Flight SQL
            service lasts (seconds); the client then logs in again.
        flight_endpoints: where a Flight SQL client reads an answer that needs no final step
            in one place (a scan, a filter, a projection over several units): ``service``,
            through the service (one endpoint); ``workers``, straight from the workers that
            hold its parts (an endpoint each, at the worker's own Flight port, with a ticket
            for one read by the caller: clients that read endpoints at once, as ADBC's
            driver does, read from every worker at once). The clients must reach the
            workers' addresses; a service with TLS hands out only endpoints that speak it
            (``endpoint_tls_cert``).
        endpoint_port: the port of each worker's Flight endpoint (0: a free one). A fixed
            port is what a firewall or a Kubernetes NetworkPolicy can name (the operator
            renders one with ``spec.flightEndpoints``); then one worker per host, or the
            second one's endpoint cannot bind and the worker refuses to start.
        endpoint_ticket_ttl_s: how long a worker's endpoint keeps a part reserved for its
            read (seconds); its shards stay readable there meanwhile, whatever moves.
        endpoint_tls_cert: a PEM certificate file (a path every node reads) with which
            the workers' endpoints serve TLS (``grpc+tls``); "" for plain gRPC. ``shardflow
            serve --tls-cert --tls-key`` sets it and the key to its own for the cluster it
            starts: a service with TLS hands out only endpoints that speak TLS.
        endpoint_tls_key: the private key of ``endpoint_tls_cert`` (a PEM file).
        audit_max_mb: the Flight SQL service's audit log starts a new file (the old one kept
            as ``audit-<UTC time>.jsonl``, the hash chain running on) once it reaches this
            many MiB.
        audit_max_days: the audit log also starts a new file once its first entry is this
            many days old (0: by size only).
        max_request_mb: the most one bulk ingest into the Flight SQL service may send
            (MiB); a bigger one is refused with an error and keeps nothing that was not
            acknowledged.
        engine: the engine workers run fragments with: "auto" (DuckDB on CPUs and AMD GPUs,
            Polars with cudf-polars on NVIDIA GPUs when installed), "duckdb", or "polars"
            (Polars SQL, on the GPU where cudf-polars can, else on the CPU).
        device_cache_mb: a worker that runs Polars keeps the shards it serves as the
            engine's own frames (in device memory on a GPU, in its process on a CPU), each
            built once from the shard's rows, extended by its appends, and read by every
            fragment without a copy out of DuckDB; at most this many MiB of them, the least
            recently used dropped beyond it. 0: half the device's memory (half the worker's
            ``worker_memory_mb`` share on a CPU); -1: none (each fragment reads its shards
            out of DuckDB). DuckDB and the data directory stay the shards' source of truth.
            The balancer counts it as capacity: no move takes a worker past it.
        node_failure_rate: a node failing more than this share of its operations
            (fragments and inserts that failed on it, missed health checks, device errors)
            over ``node_failure_window_s`` becomes *suspect*: it gets no new shards and its
            shards move off live, the most loaded first, within ``max_concurrent_moves``. It
            is re-admitted after ``suspect_cooldown_s`` without a failure (a node that keeps
            failing stays suspect and empty); one suspect a third time is *failing*: kept
            empty and reported until removed. 0 turns this off.
        node_failure_min_ops: operations a node must have done in the window before its
            rate counts (and 3 of them must have failed): one failure of an idle node is not
            a rate.
        node_failure_window_s: the sliding window of the failure rate (seconds).
        suspect_cooldown_s: seconds without a failure after which a suspect node gets
            shards again.
        test_flaky_node: for tests only, off ("") by default. "node-1=0.05" makes worker
            node-1 fail that share of its fragments (evenly spread: one in 20 here) with a
            retryable error, as a dying device would; a Ray node's name ("ray-flaky=0.2")
            makes every worker that starts on that Ray node do so.
        test_fault_move_copy: for tests only, off ("") by default. "drop_row" or
            "change_value" makes the target of every live move remove one row from, or
            change one value in, its copy once the copy is stored, so that the move's
            verification must fail and roll the move back.
        test_fault_resident: for tests only, off ("") by default. "skip_append" makes a
            worker's kept shard frames take a shard's new appends without their rows, so
            that queries over them must find rows missing.
        test_hold_results_s: for tests only, 0 (off) by default. A session with it set
            leaves every stage's fragment results on the workers up to this many seconds
            (until the test sets the session's ``results_released``) before it reads them,
            so that a test can kill the node holding them first and see the query run again
            (``db.last_report.reruns``).
        test_protocol: for tests only, 0 (off) by default: the version of the roles'
            messages a worker says it speaks (``runtime/wire.py``) instead of its own, so
            that a test sees a worker too far from the coordinator's release refused.
        test_hold_copy_s: for tests only, 0 (off) by default. The target of every live move
            waits this many seconds before its copy begins (a plain move's copy takes
            milliseconds), so that a test sees a move in flight (the console) or cancels it.
    """

    buckets: int = MAX_BUCKETS
    shards_per_worker: int = 1
    engine_threads: int = 0
    worker_memory_mb: int = 0
    local_dir: str = ""
    retry_deadline_s: float = 60.0
    load_batch_rows: int = 1_000_000
    wal_checkpoint_entries: int = 256
    wal_checkpoint_bytes: int = 64 << 20
    plan_cache_size: int = 256
    fast_lane: bool = True
    stream_buffer_mb: int = 64
    object_store_memory: int = 0
    migration_bandwidth_mb_s: float = 0.0
    migration_share: float = 0.1
    health_interval_s: float = 1.0
    health_misses: int = 3
    auto_join: bool = True
    auto_balance: bool = True
    balance_hours: str = ""
    balance_interval_s: float = 5.0
    utilization_threshold: float = 0.80
    balance_tolerance: float = 0.10
    load_swing: float = 0.20
    predictive_balancing: bool = True
    forecast_period_s: float = 86_400.0
    forecast_slots: int = 48
    max_concurrent_moves: int = 2
    max_shard_bytes: int = 1 << 40
    min_shard_bytes: int = 256 << 20
    initial_shard_bytes: int = 256 << 20
    metrics_port: int = 0
    profile_queries: bool = True
    lease_ttl_s: float = 10.0
    token_ttl_s: float = 3600.0
    flight_endpoints: str = "service"
    endpoint_port: int = 0
    endpoint_ticket_ttl_s: float = 60.0
    endpoint_tls_cert: str = ""
    endpoint_tls_key: str = ""
    max_request_mb: int = 256
    audit_max_mb: int = 64
    audit_max_days: float = 30.0
    engine: str = "auto"
    device_cache_mb: int = 0
    node_failure_rate: float = 0.01
    node_failure_min_ops: int = 100
    node_failure_window_s: float = 60.0
    suspect_cooldown_s: float = 120.0
    test_flaky_node: str = ""
    test_fault_move_copy: str = ""
    test_fault_resident: str = ""
    test_hold_results_s: float = 0.0
    test_hold_copy_s: float = 0.0
    test_protocol: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"setting {field.name} must be True or False")
                continue
            if field.type in ("str", str):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"setting {field.name} must be a number, not {value!r}")
        positive = (
            "buckets", "shards_per_worker", "load_batch_rows", "plan_cache_size", "forecast_slots",
        "stream_buffer_mb",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name} must be at least 1, got {getattr(self, name)}")
        if self.buckets > MAX_BUCKETS:
            raise ConfigError(f"setting buckets must be at most {MAX_BUCKETS}, got {self.buckets}")
        for name in (
            "engine_threads",
            "worker_memory_mb",
            "object_store_memory",
            "wal_checkpoint_entries",
            "wal_checkpoint_bytes",
            "initial_shard_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"setting {name} must not be negative")
        for name in (
            "retry_deadline_s", "health_interval_s", "lease_ttl_s", "token_ttl_s",
            "endpoint_ticket_ttl_s",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name} must be positive")
        if 0 < self.worker_memory_mb < MIN_WORKER_MEMORY_MB:
            raise ConfigError(
                f"setting worker_memory_mb must be 0 (the node's share) or at least "
                f"{MIN_WORKER_MEMORY_MB}, got {self.worker_memory_mb}"
            )
        if self.test_hold_results_s < 0:
            raise ConfigError("setting test_hold_results_s (tests only) must not be negative")
        if self.test_protocol < 0:
            raise ConfigError("setting test_protocol (tests only) must not be negative")
        if self.test_hold_copy_s < 0:
            raise ConfigError("setting test_hold_copy_s (tests only) must not be negative")
        if self.migration_bandwidth_mb_s < 0:
            raise ConfigError("setting migration_bandwidth_mb_s must not be negative")
        if not 0 < self.migration_share <= 1:
            raise ConfigError("setting migration_share must be above 0 and at most 1")
        if self.max_request_mb < 1 or self.audit_max_mb < 1:
            raise ConfigError("settings max_request_mb and audit_max_mb must be >= 1")
        if self.audit_max_days < 0:
            raise ConfigError("setting audit_max_days must not be negative")
        if self.health_misses < 1 or self.max_concurrent_moves < 1:
            raise ConfigError("settings health_misses and max_concurrent_moves must be >= 1")
        for name in (
            "balance_interval_s",
            "utilization_threshold",
            "balance_tolerance",
            "load_swing",
            "forecast_period_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name} must be positive")
        hours_of(self.balance_hours)  # a bad window is refused here
        if bool(self.endpoint_tls_cert) != bool(self.endpoint_tls_key):
            raise ConfigError("settings endpoint_tls_cert and endpoint_tls_key go together")
        if self.flight_endpoints not in FLIGHT_ENDPOINTS:
            raise ConfigError(
                f"setting flight_endpoints must be one of {', '.join(FLIGHT_ENDPOINTS)}, "
                f"got {self.flight_endpoints!r}"
            )
        if self.engine not in ENGINES:
            raise ConfigError(f"setting engine must be one of {', '.join(ENGINES)}")
        if self.test_fault_move_copy not in MOVE_COPY_FAULTS:
            raise ConfigError(
                "setting test_fault_move_copy (tests only) must be one of "
                + ", ".join(repr(f) for f in MOVE_COPY_FAULTS)
            )
        if self.test_fault_resident not in RESIDENT_FAULTS:
            raise ConfigError(
                "setting test_fault_resident (tests only) must be one of "
                + ", ".join(repr(f) for f in RESIDENT_FAULTS)
            )
        if self.device_cache_mb < -1:
            raise ConfigError("setting device_cache_mb must be -1 (none), 0 (a share) or more")
        if not 0 <= self.node_failure_rate < 1:
            raise ConfigError("setting node_failure_rate must be in [0, 1) (0: off)")
        if self.node_failure_min_ops < 1 or self.node_failure_window_s <= 0:
            raise ConfigError(
                "settings node_failure_min_ops must be >= 1 and node_failure_window_s positive"
            )
        if self.suspect_cooldown_s < 0:
            raise ConfigError("setting suspect_cooldown_s must not be negative")
        self.flaky_node()  # checks the test hook's form
        for name in ("metrics_port", "endpoint_port"):
            if not 0 <= getattr(self, name) <= MAX_PORT:
                raise ConfigError(f"setting {name} must be a port number (0: any free port)")
        if not 0 < self.min_shard_bytes < self.max_shard_bytes:
            raise ConfigError("settings need 0 < min_shard_bytes < max_shard_bytes")

    def balances_at(self, hour: int) -> bool:
        """Whether the balancer may start moves by itself at ``hour`` (UTC, 0-23)."""
        return hour in hours_of(self.balance_hours)

    def flaky_node(self) -> tuple[str, float] | None:
        """``test_flaky_node`` read: (node, share of fragments to fail), or None (off)."""
        if not self.test_flaky_node:
            return None
        node, _, share = self.test_flaky_node.partition("=")
        try:
            rate = float(share)
        except ValueError:
            rate = -1.0
        if not node or not 0 < rate <= 1:
            raise ConfigError(
                "setting test_flaky_node (tests only) takes node=share, e.g. node-1=0.05, "
                f"not {self.test_flaky_node!r}"
            )
        return node, rate

    def with_text(self, assignments: list[str]) -> Settings:
        """These settings with ``name=value`` assignments from a command line applied (the
        value read as the setting's type)."""
        changes: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for assignment in assignments:
            name, sep, text = assignment.partition("=")
            name = name.strip()
            if not sep or name not in types:
                raise ConfigError(
                    f"--set takes name=value with a setting's name, not {assignment!r}; known: "
                    + ", ".join(sorted(types))
                )
            kind = str(types[name])
            try:
                if kind in ("bool", "<class 'bool'>"):
                    if text.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(text)
                    changes[name] = text.lower() in ("true", "1")
                elif kind in ("int", "<class 'int'>"):
                    changes[name] = int(text)
                elif kind in ("float", "<class 'float'>"):
                    changes[name] = float(text)
                else:
                    changes[name] = text
            except ValueError:
                wanted = {"bool": "true or false", "int": "a whole number"}.get(
                    kind.removeprefix("<class '").removesuffix("'>"), "a number"
                )
                raise ConfigError(f"setting {name} must be {wanted}, not {text!r}") from None
        return self.replace(**changes)

    def replace(self, **changes: Any) -> Settings:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **changes)


LOOPBACK = "127.0.0.1"
"""Where everything of shardflow listens unless told otherwise: this machine only."""


@functools.lru_cache(maxsize=64)
def hours_of(window: str) -> frozenset[int]:
    """The hours (0-23) that a window such as ``"22-6,13"`` names (a range past midnight
    wraps); every hour for ``""``.

    >>> sorted(hours_of("22-1,13"))
    [0, 1, 13, 22, 23]
    """
    if not window.strip():
        return frozenset(range(24))
    hours: set[int] = set()
    for part in window.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            start, end = int(first), int(last if dash else first)
        except ValueError:
            start = end = -1
        if not (0 <= start <= 23 and 0 <= end <= 23):
            raise ConfigError(
                f'setting balance_hours takes hours 0-23 and ranges such as "22-6,13", '
                f"not {window!r}"
            )
        span = end - start if end >= start else end + 24 - start
        hours.update((start + step) % 24 for step in range(span + 1))
    return frozenset(hours)


def is_loopback(address: str) -> bool:
    """Whether an address (``host:port``) names this machine's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
