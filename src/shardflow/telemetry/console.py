"""The coordinator's read-only console: one HTTP server on the metrics port that serves the
Prometheus metrics (``/metrics``), a live page (``/``) and the page's data (``/api/state``).

The coordinator builds a :class:`ConsoleState` from what it holds; this module lays it out
(the nodes x buckets map), turns it into JSON and serves it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from itertools import pairwise
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

CACHE_S = 0.5
"""How long one snapshot answers ``/api/state``: every open page polls once a second, and a
snapshot asks every worker for its report."""
RECENT = 10
"""Rollbacks and failovers the console lists (the newest)."""
PAGE = "console.html"
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Host names the page and its data answer to: the console is reached on loopback, directly
or through a tunnel (``ssh -L``, ``kubectl port-forward``); any other name in the Host header
is a browser misled by DNS rebinding into reading the console for another site."""
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page loads nothing from anywhere and may only poll its own server."""


@dataclass(frozen=True)
class NodeView:
    """A worker as the console lists it."""

    name: str
    alive: bool
    """Whether its worker answered for this snapshot."""
    vendor: str
    model: str
    engine: str
    simulated: bool
    capacity: float
    utilization: float | None
    """Busy fraction over the balancer's last window; None until one has passed."""
    device_utilization: float | None
    shards: int
    rows: int
    bytes: int
    queries_running: int


@dataclass(frozen=True)
class ShardView:
    """One shard of a distributed table: its unit's bucket range and owner, per the catalog."""

    shard: str
    """``table#unit``, as ``db.cluster.shards()`` names it."""
    table: str
    unit: int
    node: str
    lo: int
    hi: int


@dataclass(frozen=True)
class MoveView:
    """A live move (migration, split or merge), running or finished."""

    move_id: str
    kind: str
    shards: tuple[str, ...]
    from_nodes: tuple[str, ...]
    to_nodes: tuple[str, ...]
    phase: str
    outcome: str
    started_at: float
    seconds: float


@dataclass(frozen=True)
class FailoverView:
    """A worker declared dead, and how long until its shards were served again."""

    node: str
    detected_at: float
    units: int
    seconds: float


@dataclass(frozen=True)
class ConsoleState:
    """What the console shows, taken at ``at`` (seconds since the epoch)."""

    at: float
    buckets: int
    """Virtual buckets per key (the catalog's ``n_buckets``): the width of the map."""
    epoch: int
    """The routing epoch: it changes with every switch of a move and every failover."""
    nodes: tuple[NodeView, ...]
    shards: tuple[ShardView, ...]
    moves: tuple[MoveView, ...]
    """Moves in flight."""
    rollbacks: tuple[MoveView, ...]
    """Recent moves that were rolled back, newest first."""
    failovers: tuple[FailoverView, ...]
    """Recent failovers, newest first."""
    qps: float
    queries: int
    """Queries since the coordinator started."""


@dataclass(frozen=True)
class MapCell:
    """Buckets ``lo``..``hi`` of one node's row: ``span`` columns wide, with the shards the
    node holds there (none: another node holds them)."""

    lo: int
    hi: int
    span: int
    shards: tuple[str, ...]


@dataclass(frozen=True)
class MapRow:
    node: str
    cells: tuple[MapCell, ...]


@dataclass(frozen=True)
class ShardMap:
    """Nodes x buckets: the columns are the bucket ranges that no unit boundary cuts, one
    row per node."""

    columns: tuple[tuple[int, int], ...]
    rows: tuple[MapRow, ...]


def bucket_columns(shards: Iterable[ShardView], buckets: int) -> tuple[tuple[int, int], ...]:
    """The finest split of ``0..buckets`` at every shard's bounds.

    >>> t1, u2 = ShardView("t#1", "t", 1, "n", 0, 4), ShardView("u#2", "u", 2, "n", 2, 8)
    >>> bucket_columns([t1, u2], 8)
    ((0, 2), (2, 4), (4, 8))
    """
    bounds = {0, buckets}
    for shard in shards:
        bounds |= {shard.lo, shard.hi}
    edges = sorted(bounds)
    return tuple(pairwise(edges))


def shard_map(nodes: Sequence[str], shards: Sequence[ShardView], buckets: int) -> ShardMap:
    """Lay the shards out as nodes x bucket ranges. A node's adjacent columns that hold the
    same shards become one cell, so a shard is one cell however many columns it spans
    (unless another table's unit boundary cuts it). Nodes that only shards name (one leaving)
    get rows of their own, after ``nodes``.

    Two nodes, a table of units 0..4 (on a) and 4..8 (on b), and another of one unit 0..8
    (on a):

    >>> layout = shard_map(
    ...     ["a", "b"],
    ...     [
    ...         ShardView("t#1", "t", 1, "a", 0, 4),
    ...         ShardView("t#2", "t", 2, "b", 4, 8),
    ...         ShardView("u#3", "u", 3, "a", 0, 8),
    ...     ],
    ...     8,
    ... )
    >>> layout.columns
    ((0, 4), (4, 8))
    >>> [(c.lo, c.hi, c.span, c.shards) for c in layout.rows[0].cells]
    [(0, 4, 1, ('t#1', 'u#3')), (4, 8, 1, ('u#3',))]
    >>> [(c.lo, c.hi, c.span, c.shards) for c in layout.rows[1].cells]
    [(0, 4, 1, ()), (4, 8, 1, ('t#2',))]
    """
    columns = bucket_columns(shards, buckets)
    names = list(dict.fromkeys([*nodes, *sorted({s.node for s in shards} - set(nodes))]))
    rows = []
    for node in names:
        held = [s for s in shards if s.node == node]
        cells: list[MapCell] = []
        for lo, hi in columns:
            here = tuple(sorted(s.shard for s in held if s.lo < hi and lo < s.hi))
            if cells and cells[-1].shards == here:
                last = cells[-1]
                cells[-1] = MapCell(last.lo, hi, last.span + 1, here)
            else:
                cells.append(MapCell(lo, hi, 1, here))
        rows.append(MapRow(node, tuple(cells)))
    return ShardMap(columns, tuple(rows))


def state_json(state: ConsoleState) -> dict[str, Any]:
    """The snapshot as ``/api/state`` serves it: the state's fields and its ``map``."""
    data = asdict(state)
    layout = shard_map([n.name for n in state.nodes], state.shards, state.buckets)
    data["map"] = asdict(layout)
    return data


class _Snapshots:
    """The last snapshot, served again for ``CACHE_S``; one request at a time builds a new
    one (the others wait for it instead of asking the workers too)."""

    def __init__(self, build: Callable[[], ConsoleState], cache_s: float) -> None:
        self._build = build
        self._cache_s = cache_s
        self._lock = threading.Lock()
        self._body = b""
        self._taken = float("-inf")

    def body(self) -> bytes:
        with self._lock:
            if time.monotonic() - self._taken >= self._cache_s:
                self._body = json.dumps(state_json(self._build())).encode()
                self._taken = time.monotonic()
            return self._body


class ConsoleServer:
    """Serves ``/metrics``, ``/`` and ``/api/state`` on ``host:port`` (port 0: a free one)
    from daemon threads: a slow request never holds up the coordinator."""

    def __init__(
        self,
        port: int,
        registry: CollectorRegistry,
        state: Callable[[], ConsoleState],
        host: str = "127.0.0.1",
        cache_s: float = CACHE_S,
    ) -> None:
        page = resources.files(__package__).joinpath(PAGE).read_bytes()
        snapshots = _Snapshots(state, cache_s)
        handler = partial(_Handler, registry=registry, snapshots=snapshots, page=page)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="console", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server_version = "shardflow-console"

    def __init__(
        self,
        *args: Any,
        registry: CollectorRegistry,
        snapshots: _Snapshots,
        page: bytes,
        **kwargs: Any,
    ) -> None:
        self.registry = registry
        self.snapshots = snapshots
        self.page = page
        super().__init__(*args, **kwargs)  # handles the request

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(self.registry))
        elif path not in ("/", "/api/state"):
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")
        elif not self._local_host():
            self._send(
                HTTPStatus.FORBIDDEN,
                "text/plain; charset=utf-8",
                b"the console answers on 127.0.0.1 or localhost only\n",
            )
        elif path == "/":
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.page)
        else:
            try:
                body = self.snapshots.body()
            except Exception as error:  # the page shows it and polls again
                log.exception("the console snapshot failed")
                message = json.dumps({"error": f"{type(error).__name__}: {error}"}).encode()
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", message)
                return
            self._send(HTTPStatus.OK, "application/json", body)

    def _local_host(self) -> bool:
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.strip("[]").lower() in LOCAL_HOSTS

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        if content_type.startswith("text/html"):
            self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("console %s: " + format, self.address_string(), *args)
