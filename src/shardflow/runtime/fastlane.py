"""A worker's fast lane: a fragment whose result goes to the client and whose inputs, if
any, the client holds (a query routed to one shard, above all; a later stage reading what
the client merged) is asked and answered over a TCP connection the client keeps open to
that worker, its inputs sent along, not through a Ray actor call, whose submission,
scheduling and object-store round trip cost more than a point lookup itself (measured:
~1 ms of the client's CPU and ~0.6 ms of the worker's per call, against ~0.1 ms for a
framed request on a socket).

The worker listens on its node's address (the address Ray gives it) on a port of the
system's choosing, and learns nothing from a peer before it sent the worker's token: 16
random bytes the client obtained through Ray, which authenticates that call. Requests are
JSON (the worker unpickles nothing a peer sends); answers are the fragment's measurements
(pickled, as Ray would send them) and its result as one Arrow IPC stream, or the worker's
error. A lane that fails (its worker died, a connection broke) raises :class:`LaneBroken`;
the session then uses Ray for that worker, whose answer says what happened.

A load sends its rows the same way (:meth:`Lanes.stage`): Arrow IPC straight into the
worker, not through Ray's object store, whose shared memory keeps every page a load passed
through resident in the worker's process and the store (~0.15 GiB a worker after loading
TPC-H SF 1 lineitem and orders on four; ``bench/memory.py``). The target of a move pulls
its source's snapshot the same way, chunk by chunk (:meth:`Lanes.chunk`).
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from shardflow.errors import ClusterError, Error
from shardflow.runtime.protocol import (
    FenceResult,
    FinalApplied,
    FragmentStats,
    LaneAddress,
    PartRequest,
    ShardKey,
    Workers,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_LENGTH = struct.Struct("!Q")
_OK = b"\x00"
_FAILED = b"\x01"
TOKEN_BYTES = 16
MAX_REQUEST_BYTES = 256 << 20
"""The longest request a worker reads (a fragment's SQL, IN lists included)."""
ARROW_FRAME_BYTES = 1 << 20
"""Frames of rows this large or larger are received into Arrow's memory (see _read_rows)."""
MAX_PART_BYTES = 4 << 30
"""The largest part of a load a worker reads (one unit's rows of one load batch), or input
of a fragment."""
STREAM_FRAME_BYTES = 4 << 20
"""The most bytes of one part of a streamed result (``Lanes.stream``): the size of the
record batches a Flight client gets (ADBC refuses gRPC messages over 16 MiB)."""
CONNECT_TIMEOUT_S = 2.0
MOVE_STEPS = frozenset({"chunk", "fence", "retire", "finish"})
"""What a move's target and the coordinator ask a source over its lane."""
STEP_TIMEOUT_S = 60.0
"""The longest a move's fence, finish or retire waits for its answer on a lane (they take
milliseconds). A worker cut off by a partition never answers, and a socket would wait for
TCP to give up (many minutes) while writers are held; the step fails instead, as an actor
call to a node Ray declared dead does, and the move rolls back (a retire is asked again
through Ray)."""
LANE_THREADS = 32
"""Calls a client makes over its lanes at once (the workers of a stage, a load's parts)."""


class LaneBroken(ClusterError):
    """A lane failed (not the fragment): its worker is gone, or the connection broke."""


class Run(Protocol):
    """A worker's fragment runner: (sql, bindings, epoch, profile, inputs, commits) ->
    (result, measurements); ``inputs`` are tables the fragment reads by name (an earlier
    stage's rows), ``commits`` the commit number of each table the query reads. With
    ``emit``, an engine that makes its result in parts gives them to it as it goes and
    returns an empty table of the result's schema (``WorkerNode.execute``)."""

    def __call__(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int],
        emit: Callable[[pa.Table], None] | None = None,
    ) -> tuple[pa.Table, FragmentStats]: ...


class ReaderGone(Error):
    """Internal: the client of a streamed fragment hung up; the fragment stops making parts."""


Stage = Callable[[str, Mapping[int | str, pa.Table]], int]
"""A worker's loader: (table, rows by unit) -> rows staged."""


class MoveSource(Protocol):
    """A worker as the source of moves (``SourceSide``): the steps its targets and the
    coordinator may ask over its lane."""

    def chunk(self, move_id: str, key: ShardKey) -> pa.Table | None:
        """The next chunk of the move's snapshot of ``key``, None after the last."""
        ...

    def fence(self, move_id: str) -> FenceResult:
        """Hold writes to the move's shards; their last changes and final checksums."""
        ...

    def retire(self, move_id: str) -> float | None:
        """Stop serving the moved shards; how long writers were held (None: retired)."""
        ...


Finish = Callable[[str], FinalApplied]
"""A worker as the target of a move (``TargetSide.finish_import``): fence the sources,
apply their last changes, serve the new shards; what it applied and stores."""

Reserve = Callable[[PartRequest], bytes]
"""A worker's endpoint (``PartEndpoint.reserve``): a part of an answer reserved for one
read; its ticket."""
Cancel = Callable[[bytes], bool]
"""A worker's endpoint (``PartEndpoint.cancel``): a reservation let go unread, by its
ticket; whether it was still held."""


class LaneServer:
    """The worker's end: a listening socket and a thread per connected client."""

    def __init__(
        self,
        run: Run,
        host: str,
        name: str = "worker",
        concurrency: int = 16,
        stage: Stage | None = None,
        source: MoveSource | None = None,
        finish: Finish | None = None,
        reserve: Reserve | None = None,
        endpoint: str = "",
        cancel: Cancel | None = None,
    ) -> None:
        """``concurrency``: fragments and load parts taken at once at most (as many as the
        worker's Ray calls may be; more clients wait their turn rather than crowd its
        memory). Without ``stage`` the lane takes no loads, without ``source`` no step of
        a move as its source (a snapshot's chunks, the fence, the retire), without
        ``finish`` none as its target, without ``reserve`` it
        reserves no part of an answer for the worker's Flight ``endpoint`` (its
        location)."""
        self._run = run
        self._stage = stage
        self._source = source
        self._finish = finish
        self._reserve = reserve
        self._cancel = cancel
        self._name = name
        self._running = threading.BoundedSemaphore(concurrency)
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        port = self._listener.getsockname()[1]
        steps = (("fence", "retire") if source else ()) + (("finish",) if finish else ())
        self.address = LaneAddress(
            host, port, self._token.hex(), endpoint if reserve else "", steps
        )
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        threading.Thread(target=self._accept, name=f"{name}-fast-lane", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self._serve, args=(connection,), name=f"{self._name}-lane", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.add(connection)
        if self._closed.is_set():  # closed while this connection was being accepted
            connection.shutdown(socket.SHUT_RDWR)
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                token = _read_exactly(connection, TOKEN_BYTES)
                if not hmac.compare_digest(token, self._token):
                    return
                while not self._closed.is_set():
                    request = json.loads(_read_frame(connection, MAX_REQUEST_BYTES))
                    if request.get("op") == "stage":
                        _write_frames(connection, *self._staged(request, connection))
                    elif request.get("op") == "stream":
                        self._streamed(request, connection)
                    elif request.get("op") in MOVE_STEPS:
                        _write_frames(connection, *self._move_step(request))
                    elif request.get("op") == "reserve":
                        _write_frames(connection, *self._reserved(request))
                    elif request.get("op") == "cancel":
                        _write_frames(connection, *self._cancelled(request))
                    else:
                        _write_frames(connection, *self._answer(request, connection))
            except (OSError, EOFError, ValueError, KeyError, TypeError):
                return  # the client went away, or sent what is not a request: hang up
            finally:
                with self._lock:
                    self._connections.discard(connection)

    def _answer(
        self, request: dict[str, Any], connection: socket.socket
    ) -> tuple[bytes | pa.Buffer, ...]:
        """Run a fragment; its inputs, if any, follow the request."""
        done = self._fragment(request, self._inputs(request, connection))
        if isinstance(done, bytes):
            return _FAILED, done
        result, stats = done
        return _OK, pickle.dumps(stats), to_wire(result)

    def _streamed(self, request: dict[str, Any], connection: socket.socket) -> None:
        """Run a fragment (no inputs) and send its result in parts as the engine makes them
        (DuckDB's: batch by batch; another's: whole, then cut), each a tag frame (``_OK``)
        and a frame of at most :data:`STREAM_FRAME_BYTES` of rows (its own Arrow IPC
        stream), one at least; then an empty frame, or ``_FAILED`` and the error where the
        fragment failed (before the first part or after some). Sent as they are made: the
        worker holds no more of the result than a part, and a client that reads slowly
        holds the fragment back (its snapshot stays open, as a cursor's does) instead of
        the worker's memory filling; one that hangs up stops it at its next part."""
        sent = False

        def emit(part: pa.Table) -> None:
            nonlocal sent
            for piece in slices(part, STREAM_FRAME_BYTES):
                if piece.num_rows or not sent:  # an empty part only where none was sent
                    try:
                        _write_frames(connection, _OK, to_wire(piece))
                    except OSError:
                        raise ReaderGone("the client hung up") from None
                    sent = True

        done = self._fragment(request, {}, emit)
        if isinstance(done, bytes):  # the fragment's error (the client's hang-up included)
            _write_frames(connection, _FAILED, done)
            return
        emit(done[0])  # the result whole, or (parts given) an empty table of it
        _write_frames(connection, b"")

    def _inputs(self, request: dict[str, Any], connection: socket.socket) -> dict[str, pa.Table]:
        """The tables a fragment reads, sent after its request."""
        return {
            str(name): _read_rows(connection, MAX_PART_BYTES) for name in request.get("inputs", ())
        }

    def _fragment(
        self,
        request: dict[str, Any],
        inputs: Mapping[str, pa.Table],
        emit: Callable[[pa.Table], None] | None = None,
    ) -> tuple[pa.Table, FragmentStats] | bytes:
        """Run the fragment of ``request``: the result and its measurements, or the error
        to send, pickled."""
        try:
            sql = str(request["sql"])
            bindings = {str(t): [int(u) for u in us] for t, us in request["bindings"].items()}
            epoch, profile = int(request["epoch"]), bool(request["profile"])
            commits = {str(t): int(c) for t, c in request.get("commits", {}).items()}
            with self._running:
                if emit is None:
                    return self._run(sql, bindings, epoch, profile, inputs, commits)
                return self._run(sql, bindings, epoch, profile, inputs, commits, emit=emit)
        except Error as error:
            return pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a fragment on the fast lane failed", self._name)
            return pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

    def _staged(self, request: dict[str, Any], connection: socket.socket) -> tuple[bytes, ...]:
        """Read a load's parts and stage them (they are let go when this returns: a part
        kept by the connection's thread until its next request held ~40 MB)."""
        parts = [_read_rows(connection, MAX_PART_BYTES) for _ in request["units"]]
        try:
            if self._stage is None:
                raise ClusterError(f"{self._name} takes no loads on its fast lane")
            units = [u if isinstance(u, str) else int(u) for u in request["units"]]
            with self._running:
                rows = self._stage(str(request["table"]), dict(zip(units, parts, strict=True)))
            return _OK, json.dumps(rows).encode()
        except Error as error:
            return _FAILED, pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a load on the fast lane failed", self._name)
            return _FAILED, pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

    def _move_step(self, request: dict[str, Any]) -> tuple[bytes | pa.Buffer, ...]:
        """A step of a move: as its source, the next chunk of its snapshot of one shard (an
        empty frame after the last), its fence (the answer pickled, as Ray would send it)
        or its retire (JSON); as its target, its finish (pickled). The fence, the finish's
        answer and the retire come this way because writers wait from the fence to the
        retire: each actor call's hop took 10-25 ms on a busy 2-core machine, a framed
        request on an open socket a few."""
        op, move = request["op"], str(request["move"])
        try:
            if (self._finish if op == "finish" else self._source) is None:
                raise ClusterError(f"{self._name} takes no step of a move on its fast lane")
            if op == "finish":
                assert self._finish is not None
                return _OK, pickle.dumps(self._finish(move))
            assert self._source is not None
            if op == "fence":
                return _OK, pickle.dumps(self._source.fence(move))
            if op == "retire":
                return _OK, json.dumps(self._source.retire(move)).encode()
            table, unit = request["shard"]
            chunk = self._source.chunk(move, (str(table), int(unit)))
            return _OK, b"" if chunk is None else to_wire(chunk)
        except Error as error:
            return _FAILED, pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a move's %s on the fast lane failed", self._name, op)
            return _FAILED, pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

    def _reserved(self, request: dict[str, Any]) -> tuple[bytes, ...]:
        """Reserve a part of an answer on the worker's endpoint; the ticket that reads it."""
        try:
            if self._reserve is None:
                raise ClusterError(f"{self._name} reserves no part of an answer")
            ticket = self._reserve(PartRequest.from_json(request))
            return _OK, ticket
        except Error as error:
            return _FAILED, pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a reservation on the fast lane failed", self._name)
            return _FAILED, pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

    def _cancelled(self, request: dict[str, Any]) -> tuple[bytes, ...]:
        """Let go of a reservation unread, by its ticket: b"1" where it was still held."""
        ticket = base64.b64decode(str(request["ticket"]))
        held = self._cancel is not None and self._cancel(ticket)
        return _OK, b"1" if held else b"0"

    def close(self) -> None:
        """Stop listening and hang up on every client (a call in progress ends first)."""
        self._closed.set()
        self._listener.close()
        with self._lock:
            connected = list(self._connections)
        for connection in connected:
            try:
                connection.shutdown(socket.SHUT_RD)  # wakes its thread waiting for a request
            except OSError:
                pass


class Lanes:
    """The client's end: connections to workers' lanes, kept open between queries (one per
    thread asking at a time), by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[LaneAddress, list[socket.socket]] = {}
        self._closed = False

    def execute(
        self,
        address: LaneAddress,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table] | None = None,
        commits: Mapping[str, int] | None = None,
    ) -> tuple[pa.Table, FragmentStats]:
        """Run a fragment on the worker at ``address`` (with ``inputs``, tables it reads by
        name, sent along; ``commits``, the tables' commit numbers the query was routed at):
        its result and measurements, or the worker's error raised here; :class:`LaneBroken`
        when the lane failed."""
        inputs = inputs or {}
        request = json.dumps(
            {
                "sql": sql,
                "bindings": dict(bindings),
                "epoch": epoch,
                "profile": profile,
                "inputs": list(inputs),
                "commits": dict(commits or {}),
            }
        ).encode()

        def answer(connection: socket.socket) -> tuple[pa.Table, FragmentStats]:
            stats = pickle.loads(_read_frame(connection))
            return _read_rows(connection), stats

        frames = (request, *(to_wire(table) for table in inputs.values()))
        return self._call(address, frames, answer)

    def stream(
        self,
        address: LaneAddress,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        commits: Mapping[str, int],
    ) -> Iterator[pa.Table]:
        """Run a fragment (no inputs) on the worker at ``address`` and read its result in
        parts as the worker makes them (at most :data:`STREAM_FRAME_BYTES` each; one at
        least, which holds the schema). The worker's error before its first part is raised
        here; one after some parts, by the iterator; :class:`LaneBroken` when the lane
        failed (here, or between parts: the parts read so far are then not the whole
        result). Closing the iterator early hangs up: the worker stops."""
        request = json.dumps(
            {"op": "stream", "sql": sql, "bindings": dict(bindings), "epoch": epoch,
             "profile": False, "commits": dict(commits)}
        ).encode()  # fmt: skip
        connection = self._connection(address)
        try:
            _write_frames(connection, request)
            first = _read_part(connection)
        except BaseException as failure:
            connection.close()
            if not isinstance(failure, Exception):
                raise
            raise LaneBroken(f"the fast lane to {address.host}:{address.port}: {failure}") from None
        if isinstance(first, Exception):
            self._keep(address, connection)
            raise first
        return self._parts(address, connection, first)

    def reserve(self, address: LaneAddress, request: PartRequest) -> bytes:
        """Reserve a fragment's part of an answer on the worker at ``address`` for one
        read from its Flight endpoint (``runtime/worker/endpoint.py``); the ticket."""
        frame = json.dumps({"op": "reserve", **request.to_json()}).encode()
        return self._call(address, (frame,), lambda connection: bytes(_read_frame(connection)))

    def cancel(self, address: LaneAddress, ticket: bytes) -> bool:
        """Let go of the part ``ticket`` reserved on the worker at ``address``, unread;
        whether it was still held there."""
        frame = json.dumps({"op": "cancel", "ticket": base64.b64encode(ticket).decode()})
        held = self._call(address, (frame.encode(),), lambda c: bytes(_read_frame(c)))
        return held == b"1"

    def _parts(
        self, address: LaneAddress, connection: socket.socket, first: pa.Table | None
    ) -> Iterator[pa.Table]:
        in_step = False  # whether the connection is at the start of a new call
        try:
            part: pa.Table | Exception | None = first
            while True:
                if part is None:
                    in_step = True
                    return
                if isinstance(part, Exception):
                    in_step = True
                    raise part
                yield part
                try:
                    part = _read_part(connection)
                except Exception as failure:
                    raise LaneBroken(
                        f"the fast lane to {address.host}:{address.port} broke off: {failure}"
                    ) from None
        finally:  # read to its end: kept for the next call; left early: hung up
            if in_step:
                self._keep(address, connection)
            else:
                connection.close()

    def stage(
        self, address: LaneAddress, table: str, parts: Mapping[int | str, pa.Buffer | bytes]
    ) -> int:
        """Hand a load's rows (each unit's part as :func:`to_wire` wrote it) to the worker
        at ``address``: the rows it staged, or its error raised here; :class:`LaneBroken`
        when the lane failed (the worker may have staged the rows or not)."""
        request = json.dumps({"op": "stage", "table": table, "units": list(parts)}).encode()
        return self._call(
            address, (request, *parts.values()), lambda c: int(json.loads(_read_frame(c)))
        )

    def chunk(self, address: LaneAddress, move_id: str, shard: tuple[str, int]) -> pa.Table | None:
        """The next chunk of a move's snapshot of ``shard`` from its source at ``address``
        (None after the last); :class:`LaneBroken` when the lane failed (a chunk the source
        handed out may be lost: the move's checksums then fail it)."""
        request = json.dumps({"op": "chunk", "move": move_id, "shard": list(shard)}).encode()
        return self._call(address, (request,), _read_rows_or_none)

    def fence(self, address: LaneAddress, move_id: str) -> FenceResult:
        """Fence the source at ``address`` of a move (``SourceSide.fence``);
        :class:`LaneBroken` when the lane failed (the source may be fenced: the move then
        fails and rolls back, which lets its writers go)."""
        request = json.dumps({"op": "fence", "move": move_id}).encode()
        answer: FenceResult = self._call(
            address, (request,), lambda c: pickle.loads(_read_frame(c)), STEP_TIMEOUT_S
        )
        return answer

    def finish(self, address: LaneAddress, move_id: str) -> FinalApplied:
        """Have the target at ``address`` of a move fence its sources, apply their last
        changes and promote (``TargetSide.finish_import``); :class:`LaneBroken` when the
        lane failed (the move then fails and rolls back)."""
        request = json.dumps({"op": "finish", "move": move_id}).encode()
        answer: FinalApplied = self._call(
            address, (request,), lambda c: pickle.loads(_read_frame(c)), STEP_TIMEOUT_S
        )
        return answer

    def retire(self, address: LaneAddress, move_id: str) -> float | None:
        """Retire the source at ``address`` of a switched move (``SourceSide.retire``):
        how long it held writers, None where it retired already; :class:`LaneBroken`
        when the lane failed (ask again another way: a retire is idempotent)."""
        request = json.dumps({"op": "retire", "move": move_id}).encode()
        held: float | None = self._call(
            address, (request,), lambda c: json.loads(_read_frame(c)), STEP_TIMEOUT_S
        )
        return held

    def _call(
        self,
        address: LaneAddress,
        frames: tuple[bytes | pa.Buffer, ...],
        answer: Callable[[socket.socket], T],
        timeout: float | None = None,
    ) -> T:
        """Send ``frames``, read the status and then the ``answer``; the worker's error is
        raised here, :class:`LaneBroken` when no answer came (within ``timeout`` seconds a
        send or receive, where given)."""
        connection = self._connection(address)
        try:
            connection.settimeout(timeout)
            _write_frames(connection, *frames)
            status = _read_frame(connection)
            if status == _OK:
                got = answer(connection)
            else:
                error = pickle.loads(_read_frame(connection))
        except BaseException as failure:  # no answer came: the connection is done with
            connection.close()
            if not isinstance(failure, Exception):
                raise
            raise LaneBroken(f"the fast lane to {address.host}:{address.port}: {failure}") from None
        self._keep(address, connection)
        if status != _OK:
            raise error
        return got

    def _connection(self, address: LaneAddress) -> socket.socket:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        try:
            connection = socket.create_connection(
                (address.host, address.port), timeout=CONNECT_TIMEOUT_S
            )
        except OSError as failure:
            raise LaneBroken(f"the fast lane to {address.host}:{address.port}: {failure}") from None
        try:
            connection.settimeout(None)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.sendall(bytes.fromhex(address.token))
        except OSError as failure:
            connection.close()
            raise LaneBroken(f"the fast lane to {address.host}:{address.port}: {failure}") from None
        return connection

    def _keep(self, address: LaneAddress, connection: socket.socket) -> None:
        """Keep a connection for the next call; one that ends after :meth:`close` closes."""
        with self._lock:
            if not self._closed:
                self._idle.setdefault(address, []).append(connection)
                return
        connection.close()

    def close(self) -> None:
        """Close every kept connection; those still in use close when their call ends."""
        with self._lock:
            self._closed = True
            idle = [c for connections in self._idle.values() for c in connections]
            self._idle.clear()
        for connection in idle:
            connection.close()


class LaneBook:
    """A client's lanes: each worker's address, asked once (and again of a new worker of the
    node), the connections to them, and a pool that asks several workers at once. A lane
    that failed is not used again for that worker; its worker is asked through its
    protocol implementation instead, whose answer says what happened."""

    def __init__(self, workers: Workers, enabled: bool) -> None:
        self.workers = workers
        self.enabled = enabled
        """Whether lanes are used at all (``fast_lane``)."""
        self.lanes = Lanes()
        self.pool = ThreadPoolExecutor(LANE_THREADS, thread_name_prefix="shardflow-lane")
        self._known: dict[str, tuple[object, LaneAddress | None]] = {}

    def address(self, node: str) -> LaneAddress | None:
        """Where ``node``'s worker answers over its lane; None without one."""
        if not self.enabled:
            return None
        worker = self.workers.get(node)
        known = self._known.get(node)
        if known is None or known[0] is not worker.instance:
            try:
                address = worker.fast_lane().get()
            except Error as error:  # gone (a new worker gets asked), or one without a lane
                log.info("%s has no fast lane: %s", node, error)
                address = None
            known = self._known[node] = (worker.instance, address)
        return known[1]

    def known(self, node: str) -> LaneAddress | None:
        """``node``'s lane where it was asked for already (None otherwise, and for a worker
        without one): a step that must not wait for the question (a retire, writers held)
        goes the other way until :meth:`address` asked."""
        known = self._known.get(node)
        if not self.enabled or known is None:
            return None
        return known[1] if known[0] is self.workers.get(node).instance else None

    def broken(self, node: str, error: Exception) -> None:
        """``node``'s lane failed: its worker is asked the other way from now on (a worker
        that died is then seen as gone; a new worker of the node gets a lane again)."""
        log.info("the fast lane to %s failed (%s); asking it the other way", node, error)
        known = self._known.get(node)
        if known is not None:
            self._known[node] = (known[0], None)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.lanes.close()


def to_wire(table: pa.Table) -> pa.Buffer:
    """A fragment's result as one Arrow IPC buffer, for Ray and the fast lane alike: Ray
    pickles an Arrow table column by column and buffer by buffer in Python (~0.4 ms for a
    one-row, nine-column answer, more than the query), an IPC buffer in one piece (~0.02 ms
    each way)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def slices(table: pa.Table, limit: int) -> Iterator[pa.Table]:
    """``table`` in slices of about ``limit`` bytes at most (by the average row's size);
    one, empty, for a table without rows."""
    rows = max(1, limit * table.num_rows // max(1, table.nbytes))
    if table.num_rows == 0:
        yield table
    for offset in range(0, table.num_rows, rows):
        yield table.slice(offset, rows)


def from_wire(value: pa.Table | pa.Buffer | bytes | bytearray) -> pa.Table:
    """A result sent by :func:`to_wire` (or a table put as it is) as a table."""
    if isinstance(value, pa.Table):
        return value
    with pa.ipc.open_stream(pa.py_buffer(value)) as reader:
        return reader.read_all()


def _write_frames(connection: socket.socket, *frames: bytes | pa.Buffer) -> None:
    if sum(len(frame) for frame in frames) < 1 << 16:  # one write: no wait between parts
        connection.sendall(b"".join(_LENGTH.pack(len(f)) + bytes(f) for f in frames))
        return
    for frame in frames:
        connection.sendall(_LENGTH.pack(len(frame)))
        connection.sendall(memoryview(frame))


def _read_frame(connection: socket.socket, limit: int | None = None) -> bytearray:
    return _read_exactly(connection, _frame_length(connection, limit))


def _read_rows(connection: socket.socket, limit: int | None = None) -> pa.Table:
    """A frame of Arrow IPC as a table over the bytes received. A large one is received
    into memory of Arrow's allocator, which hands it back to the system once the table is
    gone: in a bytearray, glibc's allocator kept most of a load's parts (~50 MB a worker
    for TPC-H SF 1 lineitem and orders)."""
    return _rows(connection, _frame_length(connection, limit))


def _read_part(connection: socket.socket) -> pa.Table | Exception | None:
    """The next of a streamed fragment's frames: a part of its rows, the worker's error, or
    None after the last part."""
    tag = _read_frame(connection)
    if not tag:
        return None
    if tag == _FAILED:
        error = pickle.loads(_read_frame(connection))
        return error if isinstance(error, Exception) else ClusterError(repr(error))
    return _read_rows(connection)


def _read_rows_or_none(connection: socket.socket) -> pa.Table | None:
    """A frame of :func:`_read_rows`, or None for an empty frame."""
    length = _frame_length(connection)
    return _rows(connection, length) if length else None


def _frame_length(connection: socket.socket, limit: int | None = None) -> int:
    (length,) = _LENGTH.unpack(_read_exactly(connection, _LENGTH.size))
    if limit is not None and length > limit:
        raise ValueError(f"a frame of {length} bytes is over {limit}")
    return int(length)


def _rows(connection: socket.socket, length: int) -> pa.Table:
    if length < ARROW_FRAME_BYTES:
        return from_wire(_read_exactly(connection, length))
    buffer = pa.allocate_buffer(length)
    _receive_into(connection, memoryview(buffer))
    return from_wire(buffer)


def _read_exactly(connection: socket.socket, length: int) -> bytearray:
    data = bytearray(length)
    _receive_into(connection, memoryview(data))
    return data


def _receive_into(connection: socket.socket, view: memoryview) -> None:
    while view:
        received = connection.recv_into(view)
        if received == 0:
            raise EOFError("the connection closed")
        view = view[received:]
