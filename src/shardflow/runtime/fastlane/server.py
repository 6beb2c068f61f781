"""The worker's end of its fast lane (:class:`LaneServer`): fragments, a load's parts,
a move's steps and reservations of an answer's parts, each answered on the connection it
came on."""

from __future__ import annotations

import base64
import hmac
import json
import logging
import pickle
import secrets
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import pyarrow as pa

from shardflow.errors import ClusterError, Error
from shardflow.runtime.fastlane.frames import (
    FAILED,
    MAX_PART_BYTES,
    MAX_REQUEST_BYTES,
    MOVE_STEPS,
    OK,
    STREAM_FRAME_BYTES,
    TOKEN_BYTES,
    read_exactly,
    read_frame,
    read_rows,
    slices,
    to_wire,
    write_frames,
)
from shardflow.runtime.protocol import (
    FenceResult,
    FinalApplied,
    FragmentStats,
    LaneAddress,
    PartRequest,
    ShardKey,
)

log = logging.getLogger(__name__)


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
                token = read_exactly(connection, TOKEN_BYTES)
                if not hmac.compare_digest(token, self._token):
                    return
                while not self._closed.is_set():
                    request = json.loads(read_frame(connection, MAX_REQUEST_BYTES))
                    if request.get("op") == "stage":
                        write_frames(connection, *self._staged(request, connection))
                    elif request.get("op") == "stream":
                        self._streamed(request, connection)
                    elif request.get("op") in MOVE_STEPS:
                        write_frames(connection, *self._move_step(request))
                    elif request.get("op") == "reserve":
                        write_frames(connection, *self._reserved(request))
                    elif request.get("op") == "cancel":
                        write_frames(connection, *self._cancelled(request))
                    else:
                        write_frames(connection, *self._answer(request, connection))
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
            return FAILED, done
        result, stats = done
        return OK, pickle.dumps(stats), to_wire(result)

    def _streamed(self, request: dict[str, Any], connection: socket.socket) -> None:
        """Run a fragment (no inputs) and send its result in parts as the engine makes them
        (DuckDB's: batch by batch; another's: whole, then cut), each a tag frame (``OK``)
        and a frame of at most :data:`STREAM_FRAME_BYTES` of rows (its own Arrow IPC
        stream), one at least; then an empty frame, or ``FAILED`` and the error where the
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
                        write_frames(connection, OK, to_wire(piece))
                    except OSError:
                        raise ReaderGone("the client hung up") from None
                    sent = True

        done = self._fragment(request, {}, emit)
        if isinstance(done, bytes):  # the fragment's error (the client's hang-up included)
            write_frames(connection, FAILED, done)
            return
        emit(done[0])  # the result whole, or (parts given) an empty table of it
        write_frames(connection, b"")

    def _inputs(self, request: dict[str, Any], connection: socket.socket) -> dict[str, pa.Table]:
        """The tables a fragment reads, sent after its request."""
        return {
            str(name): read_rows(connection, MAX_PART_BYTES) for name in request.get("inputs", ())
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
        parts = [read_rows(connection, MAX_PART_BYTES) for _ in request["units"]]
        try:
            if self._stage is None:
                raise ClusterError(f"{self._name} takes no loads on its fast lane")
            units = [u if isinstance(u, str) else int(u) for u in request["units"]]
            with self._running:
                rows = self._stage(str(request["table"]), dict(zip(units, parts, strict=True)))
            return OK, json.dumps(rows).encode()
        except Error as error:
            return FAILED, pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a load on the fast lane failed", self._name)
            return FAILED, pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

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
                return OK, pickle.dumps(self._finish(move))
            assert self._source is not None
            if op == "fence":
                return OK, pickle.dumps(self._source.fence(move))
            if op == "retire":
                return OK, json.dumps(self._source.retire(move)).encode()
            table, unit = request["shard"]
            chunk = self._source.chunk(move, (str(table), int(unit)))
            return OK, b"" if chunk is None else to_wire(chunk)
        except Error as error:
            return FAILED, pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a move's %s on the fast lane failed", self._name, op)
            return FAILED, pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

    def _reserved(self, request: dict[str, Any]) -> tuple[bytes, ...]:
        """Reserve a part of an answer on the worker's endpoint; the ticket that reads it."""
        try:
            if self._reserve is None:
                raise ClusterError(f"{self._name} reserves no part of an answer")
            ticket = self._reserve(PartRequest.from_json(request))
            return OK, ticket
        except Error as error:
            return FAILED, pickle.dumps(error)
        except Exception as error:  # a fault of the worker's own: say what it was
            log.exception("%s: a reservation on the fast lane failed", self._name)
            return FAILED, pickle.dumps(ClusterError(f"{self._name} failed: {error!r}"))

    def _cancelled(self, request: dict[str, Any]) -> tuple[bytes, ...]:
        """Let go of a reservation unread, by its ticket: b"1" where it was still held."""
        ticket = base64.b64decode(str(request["ticket"]))
        held = self._cancel is not None and self._cancel(ticket)
        return OK, b"1" if held else b"0"

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
