"""The client's end of the workers' fast lanes: :class:`Lanes` (connections kept open, by
address, and the calls made over them) and :class:`LaneBook` (each worker's address, asked
once, and the lanes that failed)."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pyarrow as pa

from shardflow.errors import ClusterError, Error
from shardflow.runtime.fastlane.frames import (
    CONNECT_TIMEOUT_S,
    OK,
    read_frame,
    read_part,
    read_rows,
    read_rows_or_none,
    to_wire,
    write_frames,
)
from shardflow.runtime.protocol import (
    FenceResult,
    FinalApplied,
    FragmentStats,
    LaneAddress,
    PartRequest,
    Workers,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

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
            stats = pickle.loads(read_frame(connection))
            return read_rows(connection), stats

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
            write_frames(connection, request)
            first = read_part(connection)
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
        return self._call(address, (frame,), lambda connection: bytes(read_frame(connection)))

    def cancel(self, address: LaneAddress, ticket: bytes) -> bool:
        """Let go of the part ``ticket`` reserved on the worker at ``address``, unread;
        whether it was still held there."""
        frame = json.dumps({"op": "cancel", "ticket": base64.b64encode(ticket).decode()})
        held = self._call(address, (frame.encode(),), lambda c: bytes(read_frame(c)))
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
                    part = read_part(connection)
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
            address, (request, *parts.values()), lambda c: int(json.loads(read_frame(c)))
        )

    def chunk(self, address: LaneAddress, move_id: str, shard: tuple[str, int]) -> pa.Table | None:
        """The next chunk of a move's snapshot of ``shard`` from its source at ``address``
        (None after the last); :class:`LaneBroken` when the lane failed (a chunk the source
        handed out may be lost: the move's checksums then fail it)."""
        request = json.dumps({"op": "chunk", "move": move_id, "shard": list(shard)}).encode()
        return self._call(address, (request,), read_rows_or_none)

    def fence(self, address: LaneAddress, move_id: str) -> FenceResult:
        """Fence the source at ``address`` of a move (``SourceSide.fence``);
        :class:`LaneBroken` when the lane failed (the source may be fenced: the move then
        fails and rolls back, which lets its writers go)."""
        request = json.dumps({"op": "fence", "move": move_id}).encode()
        answer: FenceResult = self._call(
            address, (request,), lambda c: pickle.loads(read_frame(c)), STEP_TIMEOUT_S
        )
        return answer

    def finish(self, address: LaneAddress, move_id: str) -> FinalApplied:
        """Have the target at ``address`` of a move fence its sources, apply their last
        changes and promote (``TargetSide.finish_import``); :class:`LaneBroken` when the
        lane failed (the move then fails and rolls back)."""
        request = json.dumps({"op": "finish", "move": move_id}).encode()
        answer: FinalApplied = self._call(
            address, (request,), lambda c: pickle.loads(read_frame(c)), STEP_TIMEOUT_S
        )
        return answer

    def retire(self, address: LaneAddress, move_id: str) -> float | None:
        """Retire the source at ``address`` of a switched move (``SourceSide.retire``):
        how long it held writers, None where it retired already; :class:`LaneBroken`
        when the lane failed (ask again another way: a retire is idempotent)."""
        request = json.dumps({"op": "retire", "move": move_id}).encode()
        held: float | None = self._call(
            address, (request,), lambda c: json.loads(read_frame(c)), STEP_TIMEOUT_S
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
            write_frames(connection, *frames)
            status = read_frame(connection)
            if status == OK:
                got = answer(connection)
            else:
                error = pickle.loads(read_frame(connection))
        except BaseException as failure:  # no answer came: the connection is done with
            connection.close()
            if not isinstance(failure, Exception):
                raise
            raise LaneBroken(f"the fast lane to {address.host}:{address.port}: {failure}") from None
        self._keep(address, connection)
        if status != OK:
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
