"""A worker's Flight endpoint: a client reads its part of an answer straight from the
worker that holds it, not through the service (``docs/service.md``, parallel endpoints).

A session *reserves* a part first (over the worker's fast lane, :meth:`PartEndpoint.reserve`):
the worker binds the fragment to its shards as a fragment that begins is bound
(``WorkerNode.bind``): a move, split or merge after that leaves them readable here until the
part is read or its reservation expires. The worker answers with a ticket it signs
(HMAC-SHA256, a key of this worker's own that never leaves it): the reservation's id, this
node, the user it is for and the expiry. The service puts the ticket into the ``FlightInfo``
it answers with, one endpoint per worker, located at the worker's own Flight port; the
client reads each one with ``DoGet`` (ADBC's driver reads them at once).

A ticket is good for one read, by the caller it was reserved for (the SHA-256 of the bearer
token the service authenticated is kept with it; the client sends the same header to the
worker), until it expires (``endpoint_ticket_ttl_s``). Every other ticket is refused and the
refusal goes to the audit log: a forged one (its signature does not hold), an expired or
used one, another caller's. A part that fails as it is read (its worker dies) is a
retryable Flight error: the client runs the query again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import pyarrow as pa
import pyarrow.flight as flight

from shardflow.audit import AuditLog
from shardflow.engine.duckdb_engine import as_schema
from shardflow.errors import ConfigError, Error, Retryable
from shardflow.runtime.fastlane import ReaderGone
from shardflow.runtime.protocol import PartRequest, credential_digest
from shardflow.runtime.worker.reads import BoundPart

if TYPE_CHECKING:
    from shardflow.runtime.worker.node import WorkerNode

log = logging.getLogger(__name__)

TICKET_PREFIX = b"sfp1."
SWEEP_INTERVAL_S = 1.0
"""How often reservations past their expiry are let go."""
QUEUED_PARTS = 4
"""Parts of a result made ahead of the client's reading (then the fragment waits)."""
_DONE = object()


@dataclass(frozen=True)
class Reservation:
    """A part of an answer bound to this worker's shards, waiting for its one read."""

    request: PartRequest
    part: BoundPart
    expires: float
    """Wall-clock time (``time.time``) after which it is refused and let go."""


class _CallerFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    def start_call(self, info: flight.CallInfo, headers: dict[str, list[Any]]) -> _Caller:
        values = headers.get("authorization", [])
        value = values[0] if values else ""
        value = value.decode() if isinstance(value, bytes) else str(value)
        return _Caller(value.partition(" ")[2])


class _Caller(flight.ServerMiddleware):  # type: ignore[misc]
    def __init__(self, credential: str) -> None:
        self.digest = credential_digest(credential)


class PartEndpoint(flight.FlightServerBase):  # type: ignore[misc]
    """The worker's Flight server for the parts of answers reserved on it (see the module)."""

    def __init__(
        self,
        reads: WorkerNode,
        host: str,
        name: str,
        audit: AuditLog | None = None,
        concurrency: int = 16,
        tls: tuple[bytes, bytes] | None = None,
        port: int = 0,
    ) -> None:
        """``tls``: a PEM certificate and its key, to serve ``grpc+tls`` with; ``port``:
        the one to listen on (0: a free one; a taken one is a ``ConfigError``)."""
        scheme = "grpc+tls" if tls is not None else "grpc+tcp"
        try:
            super().__init__(
                f"{scheme}://{host}:{port}",
                middleware={"caller": _CallerFactory()},
                tls_certificates=[flight.CertKeyPair(*tls)] if tls is not None else [],
            )
        except (OSError, flight.FlightError, pa.ArrowException) as error:
            raise ConfigError(
                f"{name}: its Flight endpoint cannot listen on {host}:{port} (setting "
                f"endpoint_port; a fixed port takes one worker per host): {error}"
            ) from None
        self.location = f"{scheme}://{host}:{self.port}"
        self._reads = reads
        self._name = name
        self._audit = audit
        self._key = secrets.token_bytes(32)
        self._running = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._sweep, name=f"{name}-endpoint-sweep", daemon=True).start()

    # -- reserving ----------------------------------------------------------------------
    def reserve(self, request: PartRequest) -> bytes:
        """Bind a part to this worker's shards (refused as a fragment is: ``Moved``, a
        table changed) and answer the ticket that reads it once."""
        part = self._reads.bind(request.bindings, request.epoch, request.commits)
        reservation_id = secrets.token_hex(16)
        expires = time.time() + request.ttl_s
        with self._lock:
            self._reserved[reservation_id] = Reservation(request, part, expires)
        claims = {"id": reservation_id, "node": self._name, "user": request.user, "exp": expires}
        body = base64.urlsafe_b64encode(json.dumps(claims).encode())
        return TICKET_PREFIX + body + b"." + self._sign(body)

    def cancel(self, ticket: bytes) -> bool:
        """Let go of the reservation ``ticket`` reads, unread (the client's session asks,
        over the lane, when another worker's part of the same answer failed): whether it
        was still held. A ticket this worker did not sign cancels nothing."""
        claims = self._claims(ticket)
        if claims is None:
            return False
        with self._lock:
            reservation = self._reserved.pop(str(claims["id"]), None)
        if reservation is None:
            return False
        self._reads.unbind(reservation.part)
        return True

    def _claims(self, ticket: bytes) -> dict[str, Any] | None:
        """The claims of a ticket this worker signed (None: any other bytes)."""
        body, _, signature = ticket.removeprefix(TICKET_PREFIX).partition(b".")
        if not ticket.startswith(TICKET_PREFIX) or not hmac.compare_digest(
            signature, self._sign(body)
        ):
            return None
        claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body))
        return claims

    def _sign(self, body: bytes) -> bytes:
        return base64.urlsafe_b64encode(hmac.new(self._key, body, hashlib.sha256).digest())

    def _sweep(self) -> None:
        while not self._closed.wait(SWEEP_INTERVAL_S):
            self.expire()

    def expire(self, now: float | None = None) -> int:
        """Let go of the reservations past their expiry, unread; how many."""
        moment = time.time() if now is None else now
        with self._lock:
            gone = [k for k, r in self._reserved.items() if r.expires <= moment]
            expired = [self._reserved.pop(k) for k in gone]
        for reservation in expired:
            self._reads.unbind(reservation.part)
        return len(expired)

    @property
    def reserved(self) -> int:
        """Reservations waiting for their read."""
        with self._lock:
            return len(self._reserved)

    # -- reading ------------------------------------------------------------------------
    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> Any:
        reservation = self._redeem(context, ticket.ticket)
        return flight.GeneratorStream(reservation.request.schema, self._parts(reservation))

    def _redeem(self, context: flight.ServerCallContext, ticket: bytes) -> Reservation:
        """The reservation ``ticket`` reads, taken (it is read once); refused and audited
        where the ticket is forged, expired, used, or another caller's."""
        claims = self._claims(ticket)
        if claims is None:
            self._refuse("?", "a ticket this worker did not sign")
        caller = context.get_middleware("caller")
        digest = caller.digest if caller is not None else ""
        with self._lock:
            reservation = self._reserved.get(str(claims["id"]))
            if float(claims["exp"]) <= time.time():
                refusal = "an expired ticket"
            elif reservation is None:
                refusal = "a ticket read already"
            elif reservation.request.caller and not hmac.compare_digest(
                reservation.request.caller, digest
            ):
                refusal = "another caller's ticket"
            else:
                del self._reserved[str(claims["id"])]  # read once
                return reservation
        self._refuse(str(claims["user"]), refusal)

    def _refuse(self, who: str, why: str) -> NoReturn:
        log.warning("%s refused %s", self._name, why)
        if self._audit is not None:
            try:
                self._audit.record(who, "read endpoint", {"node": self._name}, f"refused: {why}", 0)
            except OSError as error:  # the refusal stands; the log's trouble is said
                log.error("%s could not write the audit log: %s", self._name, error)
        raise flight.FlightUnauthorizedError(
            f"PermissionDeniedError: {self._name} refused {why}; run the query again"
        )

    def _parts(self, reservation: Reservation) -> Iterator[pa.RecordBatch]:
        """The part's record batches as the engine makes them: it runs on a thread of its
        own, a few parts ahead of the client at most; a client that hangs up stops it, and
        so does a stream dropped unread (its shards are let go either way)."""
        parts: queue.Queue[object] = queue.Queue(QUEUED_PARTS)
        gone = threading.Event()

        def put(item: object) -> bool:
            """Hand ``item`` to the reader; False once the client hung up."""
            while not gone.is_set():
                try:
                    parts.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def emit(part: pa.Table) -> None:
            if not put(part):
                raise ReaderGone("the client hung up")

        def run() -> None:
            outcome: object = _DONE
            try:
                with self._running:
                    asked = reservation.request
                    result, _ = self._reads.execute(
                        asked.sql, asked.bindings, asked.epoch, {}, False, None, emit,
                        reservation.part,
                    )  # fmt: skip
                if result.num_rows:  # an engine that gives no parts answers whole
                    emit(result)
            except BaseException as error:  # told to the client below
                outcome = error
            put(outcome)

        def read() -> Iterator[pa.RecordBatch]:
            try:
                while True:
                    item = parts.get()
                    if item is _DONE:
                        return
                    if isinstance(item, BaseException):
                        raise _flight_error(item, self._name)
                    assert isinstance(item, pa.Table)
                    yield from as_schema(item, reservation.request.schema).to_batches()
            finally:
                gone.set()

        batches = read()
        weakref.finalize(batches, gone.set)  # dropped before its first batch was asked
        threading.Thread(target=run, name=f"{self._name}-endpoint-part", daemon=True).start()
        return batches

    def close(self) -> None:
        self._closed.set()
        self.shutdown()


def _flight_error(error: BaseException, node: str) -> flight.FlightError:
    """``error`` as the client should read it: the cluster's trouble is retryable
    (UNAVAILABLE), the query's own error is said as it is."""
    if isinstance(error, Retryable | ReaderGone):
        return flight.FlightUnavailableError(
            f"AnswerInterrupted: {node} could not finish its part of the answer ({error}); "
            "run the query again"
        )
    if isinstance(error, Error):
        return flight.FlightServerError(f"{type(error).__name__}: {error}")
    log.error("%s: a part of an answer failed", node, exc_info=error)
    return flight.FlightServerError(f"{node} failed: {error!r}")
