"""The Arrow Flight SQL server: every client (ADBC drivers in Python, Go, Java, C; JDBC;
``pyarrow.flight``; ``shardflow.connect("grpc://...")``) reaches the cluster here.

One :class:`FlightSqlService` fronts one :class:`~shardflow.api.Database`. Every call is
authenticated by :class:`AuthMiddlewareFactory` (Flight's basic-auth handshake gives a
bearer token; service tokens are bearer tokens too) and checked against the caller's role
before it does anything; control actions and refused calls go to the audit log.

A statement runs when its ``GetFlightInfo`` arrives (the answer's schema is part of the
reply); ``DoGet`` then streams the answer's record batches and forgets it. Answers that no
one fetches expire.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import sqlglot
from sqlglot import exp

from shardflow.audit import AuditLog
from shardflow.errors import (
    ConfigError,
    Error,
    MoveRefusedError,
    PermissionDeniedError,
    QueryError,
    SchemaMismatchError,
    SqlSyntaxError,
    TableError,
    TableExistsError,
    UnknownShardError,
    UnknownTableError,
)
from shardflow.flightsql import wire as fsql
from shardflow.records import AnswerPart
from shardflow.service import access as grants
from shardflow.service.access import Access, Needs
from shardflow.service.auth import AuthStore, Principal, TokenIssuer, role_allows
from shardflow.sql.parameters import bind
from shardflow.sql.statements import (
    ChangeRows,
    CreateTableAs,
    DropTable,
    changes_tables,
    statement_of,
)

if TYPE_CHECKING:
    from shardflow.api import Database

log = logging.getLogger(__name__)
R = TypeVar("R")
CATALOG = "shardflow"
SCHEMA = "main"
TABLE_TYPE = "TABLE"
MAX_COMMAND_BYTES = 1 << 20
"""A descriptor, ticket or action body larger than this is refused unread."""
RESULT_TTL_S = 300.0
MAX_PENDING_RESULTS = 1024
MAX_PREPARED = 4096
INGEST_CHUNK_BYTES = 64 << 20
BATCH_BYTES = 4 << 20
"""Answers stream in record batches of about this size."""

# Flight actions shardflow adds (DoAction type -> role needed); Flight SQL's own actions
# (prepared statements) need ``reader``
CONTROL_ACTIONS = {
    "migrate": "operator",
    "split": "operator",
    "merge": "operator",
    "drain": "operator",
    "cancel_drain": "operator",
    "drain_host": "operator",
    "rebalance": "operator",
    "cancel": "operator",
    "pause_balancer": "operator",
    "resume_balancer": "operator",
    "backup": "operator",
    "add_node": "operator",
    "nodes": "operator",
    "shards": "operator",
    "migrations": "operator",
    "metrics_url": "operator",
    "settings": "operator",
}
DATA_ACTIONS = {
    "explain": "reader",
    "profile": "reader",
    "tables": "reader",
    "drop_table": "writer",
}
SQL_ACTIONS = {"CreatePreparedStatement": "reader", "ClosePreparedStatement": "reader"}
AUDITED_ACTIONS = {*CONTROL_ACTIONS, "drop_table"}
"""Written to the audit log with their outcome (every denied call is, too)."""


# -- authentication -----------------------------------------------------------------------
class _Caller(flight.ServerMiddleware):  # type: ignore[misc]
    """The authenticated caller of one Flight call."""

    def __init__(self, principal: Principal, token: str | None = None, bearer: str = "") -> None:
        self.principal = principal
        self._token = token
        self.bearer = bearer
        """The bearer token the call carried ("" on the password handshake): the parts of
        an answer read from the workers are reserved for its holder."""

    def sending_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._token}"} if self._token else {}


class AuthMiddlewareFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Authenticates every call: ``Basic`` credentials on the handshake give a bearer token
    (sent back in the ``authorization`` header); every other call carries a bearer token,
    from a handshake or a service account."""

    def __init__(
        self, store: AuthStore, issuer: TokenIssuer, on_failure: Callable[[str, str], None]
    ) -> None:
        super().__init__()
        self._store = store
        self._issuer = issuer
        self._on_failure = on_failure

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[Any]]) -> _Caller:
        values = [_text(v) for v in headers.get("authorization", [])]
        value = values[0] if values else ""
        scheme, _, credentials = value.partition(" ")
        if info.method == flight.FlightMethod.HANDSHAKE and scheme.lower() == "basic":
            name, password = _basic(credentials)
            principal = self._store.verify_password(name, password)
            if principal is None:
                self._refuse(f"wrong user name or password for {name!r}", name)
            return _Caller(principal, self._issuer.issue(principal))
        if scheme.lower() == "bearer" and credentials:
            issued = self._issuer.resolve(credentials)
            principal = (
                self._store.current(issued)
                if issued is not None
                else self._store.principal_for_token(credentials)
            )
            if issued is not None and principal is None:
                self._refuse(f"user {issued.name!r} was removed", issued.name)
            if principal is None:
                self._refuse("unknown or expired token; authenticate again")
            echo = credentials if info.method == flight.FlightMethod.HANDSHAKE else None
            return _Caller(principal, echo, credentials)
        self._refuse("authentication required: user name and password, or a bearer token")

    def _refuse(self, why: str, who: str = "?") -> NoReturn:
        self._on_failure(who, why)
        raise flight.FlightUnauthenticatedError(f"AuthenticationError: {why}")


class _HeadersOnly(flight.ServerAuthHandler):  # type: ignore[misc]
    """Flight serves the handshake only with an auth handler; the middleware above does
    the authenticating, from the call's headers."""

    def authenticate(self, outgoing: Any, incoming: Any) -> None:
        return None

    def is_valid(self, token: bytes) -> str:
        return ""


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _basic(credentials: str) -> tuple[str, str]:
    try:
        padded = credentials + "=" * (-len(credentials) % 4)  # Go's driver sends it unpadded
        name, _, password = base64.b64decode(padded, validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        raise flight.FlightUnauthenticatedError(
            "AuthenticationError: malformed basic credentials"
        ) from None
    return name, password


# -- errors as Flight errors --------------------------------------------------------------
def flight_error(error: BaseException) -> BaseException:
    """A shardflow error as the Flight error a client maps to its own exceptions (ADBC:
    DB-API errors); the message keeps shardflow's error name and text."""
    text = f"{type(error).__name__}: {error}"
    flight_answer = isinstance(error, flight.FlightError)  # answered without a traceback
    arrow_answer = isinstance(error, pa.ArrowException)  # an answer, said as it is
    if flight_answer or arrow_answer:
        if arrow_answer:
            setattr(error, "shardflow_error", type(error).__name__)  # noqa: B010
        return error
    text = _without_paths(text)
    kind: type[Exception] = flight.FlightServerError
    if isinstance(error, PermissionDeniedError):
        kind = flight.FlightUnauthorizedError  # PERMISSION_DENIED: the client's own
    elif isinstance(error, UnknownTableError | UnknownShardError):
        kind = pa.ArrowKeyError  # NOT_FOUND
    elif isinstance(
        error, QueryError | ConfigError | TableError | SchemaMismatchError | MoveRefusedError
    ):
        kind = pa.ArrowInvalid  # INVALID_ARGUMENT
    elif isinstance(error, Error):
        kind = flight.FlightUnavailableError  # the cluster could not serve it now
    else:
        log.exception("internal error serving a Flight call", exc_info=error)
        text = f"internal error: {text}"
    answer = kind(text)
    answer.shardflow_error = type(error).__name__  # type: ignore[attr-defined]
    return answer


_HIDDEN: dict[str, str] = {}
"""The server's own folders and what an error says in their place."""


def _rows_changed(answer: pa.Table, query: str) -> int:
    """The rows statement ``query`` added, changed or emptied (its ``count``: INSERT,
    UPDATE, DELETE, TRUNCATE; the rows a DELETE or UPDATE ... RETURNING gave back), as a
    Flight SQL update answers them; -1 (unknown) for the others."""
    change = statement_of(query)
    if isinstance(change, ChangeRows) and change.returning is not None:
        return int(answer.num_rows)
    if answer.column_names != ["count"]:
        return -1
    return int(sum(value or 0 for value in answer.column("count").to_pylist()))


def hide_paths(folders: dict[str, str]) -> None:
    """Say ``folders`` (the data directory, the spill folder, the service user's home) by
    their names in every error a client gets, not by their paths."""
    for path, name in folders.items():
        if path and len(path) > 1:
            _HIDDEN[os.path.realpath(path)] = name
            _HIDDEN[path] = name


def _without_paths(text: str) -> str:
    for path in sorted(_HIDDEN, key=len, reverse=True):  # the longest (innermost) first
        text = text.replace(path, _HIDDEN[path])
    return text


def _plainly(handler: Callable[..., R]) -> Callable[..., R]:
    """A Flight call whose every error reaches the client as :func:`flight_error` makes
    it: shardflow's error class and message, never this process's traceback."""

    def call(self: Any, /, *args: Any, **kwargs: Any) -> R:
        try:
            return handler(self, *args, **kwargs)
        except Exception as error:
            raise flight_error(error) from None

    functools.update_wrapper(call, handler)
    return call


def _terse_details() -> None:
    """A Python exception a Flight call ends with reaches the client with its traceback
    (pyarrow formats it into the status's detail with ``traceback.format_exception``): the
    server's source paths and stack, for any client to read. Our answers carry shardflow's
    error class and message only; the traceback stays here, in the log of internal errors.
    Only exceptions :func:`flight_error` made are formatted so; every other traceback of
    this process is formatted as before."""
    if getattr(traceback.format_exception, "shardflow", False):
        return
    formatted = traceback.format_exception

    def format_exception(exc: Any, /, *args: Any, **kwargs: Any) -> list[str]:
        value = args[0] if args and args[0] is not None else exc
        name = getattr(value, "shardflow_error", None)
        if isinstance(name, str):
            return [name]
        return formatted(exc, *args, **kwargs)

    format_exception.shardflow = True  # type: ignore[attr-defined]
    traceback.format_exception = format_exception


def _denied(what: str, role: str, needed: str) -> flight.FlightUnauthorizedError:
    return flight.FlightUnauthorizedError(
        f"PermissionDeniedError: {what} needs role {needed}; this caller is {role}"
    )


# -- state kept between calls -------------------------------------------------------------
@dataclass
class _Answer:
    owner: str
    table: pa.Table | pa.RecordBatchReader
    """The answer whole, or read as it arrives (a query's)."""
    expires: float


@dataclass
class _Prepared:
    owner: str
    query: str
    placeholders: list[exp.Placeholder]
    parameters: pa.Table | None = None


class _Expiring(OrderedDict[bytes, Any]):
    """Handles to answers or prepared statements, oldest first, bounded."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.lock = threading.Lock()

    def put(self, key: bytes, value: Any) -> None:
        with self.lock:
            now = time.monotonic()
            while self and (
                len(self) >= self.limit or getattr(next(iter(self.values())), "expires", now) < now
            ):
                _, old = self.popitem(last=False)
                if isinstance(old, _Answer):
                    _close(old)
            self[key] = value

    def take(self, key: bytes, keep: bool = False) -> Any:
        with self.lock:
            return self.get(key) if keep else self.pop(key, None)


# -- the service ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ServiceOptions:
    host: str = "127.0.0.1"
    port: int = 8815
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    token_ttl_s: float = 3600.0
    max_request_bytes: int = 256 << 20
    """The most bytes one bulk ingest may send."""
    audit_max_bytes: int = 64 << 20
    audit_max_age_s: float = 30 * 86400.0
    """When the audit log starts a new file (``AuditLog``)."""


class FlightSqlService(flight.FlightServerBase):  # type: ignore[misc]
    """Serves ``db`` over Arrow Flight SQL, with authentication, roles and an audit log."""

    def __init__(self, db: Database, data_dir: str, options: ServiceOptions) -> None:
        tls = options.tls_cert is not None and options.tls_key is not None
        scheme = "grpc+tls" if tls else "grpc+tcp"
        _terse_details()  # no traceback of this process in an answer
        self.db = db
        self.options = options
        self.store = AuthStore(data_dir)
        self.access = Access(db, self.store)
        spill = db.settings.local_dir or os.path.join(tempfile.gettempdir(), "shardflow-local")
        hide_paths(
            {data_dir: "<data directory>", spill: "<local_dir>", os.path.expanduser("~"): "~"}
        )
        self.audit = AuditLog(data_dir, options.audit_max_bytes, options.audit_max_age_s)
        self.audit.check_private()  # refused at start, before anything is served
        # signed with the data directory's key: every replica takes every replica's tokens
        self.issuer = TokenIssuer(options.token_ttl_s, key=self.store.signing_key())
        self._answers = _Expiring(MAX_PENDING_RESULTS)
        self._prepared = _Expiring(MAX_PREPARED)
        factory = AuthMiddlewareFactory(self.store, self.issuer, self._auth_failed)
        super().__init__(
            location=f"{scheme}://{options.host}:{options.port}",
            auth_handler=_HeadersOnly(),
            middleware={"auth": factory},
            tls_certificates=[flight.CertKeyPair(options.tls_cert, options.tls_key)] if tls else [],
        )
        self.location = f"{scheme}://{options.host}:{self.port}"
        self._from_workers = db.settings.flight_endpoints == "workers"
        """Whether answers are read straight from the workers (with TLS, only from workers
        whose endpoints speak it: ``endpoint_tls_cert``)."""
        self._tls = tls

    # -- bookkeeping --------------------------------------------------------------------
    def _auth_failed(self, who: str, why: str) -> None:
        self.audit.record(who, "authenticate", {}, f"refused: {why}", 0.0)
        self._count(None)

    def _count(self, denied_action: str | None) -> None:
        try:
            self.db.cluster.record_access(denied_action)
        except Exception:  # metrics never fail a call
            log.debug("could not count a refused call", exc_info=True)

    @contextmanager
    def _audited(self, who: str, action: str, arguments: dict[str, Any]) -> Iterator[None]:
        """Write ``action`` to the audit log when it ends: ok, or the error it raised."""
        started = time.perf_counter()
        try:
            yield
        except Exception as error:
            outcome = f"error: {type(error).__name__}: {error}"
            self.audit.record(who, action, arguments, outcome, time.perf_counter() - started)
            raise
        self.audit.record(who, action, arguments, "ok", time.perf_counter() - started)

    def _caller(self, context: flight.ServerCallContext) -> Principal:
        caller = context.get_middleware("auth")
        if caller is None:  # the middleware authenticates every call; never served bare
            raise flight.FlightUnauthenticatedError("AuthenticationError: not authenticated")
        principal: Principal = caller.principal
        return principal

    def _require(
        self,
        context: flight.ServerCallContext,
        what: str,
        needed: str,
        arguments: dict[str, Any] | None = None,
    ) -> Principal:
        principal = self._caller(context)
        if not role_allows(principal.role, needed):
            outcome = f"denied: needs {needed}"
            self.audit.record(principal.name, what, arguments or {}, outcome, 0.0)
            self._count(what)
            raise _denied(what, principal.role, needed)
        return principal

    # -- Flight calls -----------------------------------------------------------------
    @_plainly
    def get_flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.FlightInfo:
        return self._flight_info(context, descriptor, parts=True)

    def _flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor, parts: bool
    ) -> flight.FlightInfo:
        """The answer's ``FlightInfo``; with ``parts`` its parts may be reserved on the
        workers for the client to read there (not for ``GetSchema``, which reads none)."""
        name, command = _command(descriptor)
        try:
            answer: pa.Table | pa.RecordBatchReader
            if name == "CommandStatementQuery":
                principal = self._require(context, "query", "reader")
                answer = self._statement(context, principal, command.query, True, parts)
                if isinstance(answer, _Parts):  # read straight from the workers
                    return _parts_info(descriptor, answer)
            elif name == "CommandPreparedStatementQuery":
                principal = self._require(context, "query", "reader")
                answer = self._run_prepared(context, principal, command.prepared_statement_handle)
            else:
                principal = self._require(context, "metadata", "reader")
                table = self._metadata(principal, name, command)
                return _info(descriptor, table.schema, descriptor.command, table)
        except Exception as error:
            raise flight_error(error) from None
        handle = secrets.token_bytes(16)
        self._answers.put(handle, _Answer(principal.name, answer, time.monotonic() + RESULT_TTL_S))
        ticket = fsql.pack(fsql.new("TicketStatementQuery", statement_handle=handle))
        return _info(descriptor, answer.schema, ticket, answer)

    @_plainly
    def get_schema(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.SchemaResult:
        info = self._flight_info(context, descriptor, parts=False)
        for endpoint in info.endpoints:  # the answer is not fetched: its reading stops
            with contextlib.suppress(fsql.MalformedCommand):
                name, ticket = fsql.unpack(endpoint.ticket.ticket)
                if name == "TicketStatementQuery":
                    _close(self._answers.take(ticket.statement_handle))
        return flight.SchemaResult(info.schema)

    @_plainly
    def do_get(
        self, context: flight.ServerCallContext, ticket: flight.Ticket
    ) -> flight.FlightDataStream:
        if len(ticket.ticket) > MAX_COMMAND_BYTES:
            raise flight.FlightServerError("ticket too large")
        try:
            name, command = fsql.unpack(ticket.ticket)
        except fsql.MalformedCommand as error:
            raise pa.ArrowInvalid(f"not a ticket of this server: {error}") from None
        if name == "TicketStatementQuery":
            principal = self._require(context, "query", "reader")
            answer = self._answers.take(command.statement_handle)
            if answer is None or answer.owner != principal.name:
                raise pa.ArrowKeyError(
                    "unknown or expired ticket (not from this server, fetched already, or "
                    f"older than {RESULT_TTL_S:g}s); run the statement again"
                )
            if isinstance(answer.table, pa.RecordBatchReader):
                return flight.GeneratorStream(answer.table.schema, _read(answer.table))
            return _stream(answer.table)
        principal = self._require(context, "metadata", "reader")
        try:
            return _stream(self._metadata(principal, name, command))
        except Exception as error:
            raise flight_error(error) from None

    @_plainly
    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        name, command = _command(descriptor)
        try:
            if name == "CommandStatementIngest":
                arguments = {"table": command.table, "options": dict(command.options)}
                principal = self._require(context, "ingest", "writer", arguments)
                with self._audited(principal.name, "ingest", arguments):
                    count = self._ingest(principal, command, reader)
                writer.write(pa.py_buffer(_update_result(count)))
            elif name == "CommandPreparedStatementQuery":
                principal = self._require(context, "query", "reader")
                handle = command.prepared_statement_handle
                self._bind(principal, handle, reader.read_all())
                result = fsql.new("DoPutPreparedStatementResult", prepared_statement_handle=handle)
                writer.write(pa.py_buffer(result.SerializeToString()))
            elif name == "CommandStatementUpdate":
                principal = self._require(context, "update", "reader")
                changed = self._whole(context, principal, command.query)
                writer.write(pa.py_buffer(_update_result(_rows_changed(changed, command.query))))
            elif name == "CommandPreparedStatementUpdate":
                principal = self._require(context, "update", "reader")
                prepared = self._prepared_of(principal, command.prepared_statement_handle)
                if prepared.parameters is None:
                    prepared.parameters = reader.read_all()
                answer = self._run_prepared(context, principal, command.prepared_statement_handle)
                changed = _rows_changed(answer, prepared.query)
                writer.write(pa.py_buffer(_update_result(changed)))
            else:
                raise pa.ArrowInvalid(f"DoPut does not take {name}")
        except Exception as error:
            raise flight_error(error) from None

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        described = {
            "CreatePreparedStatement": "Flight SQL: prepare a statement (reader)",
            "ClosePreparedStatement": "Flight SQL: close a prepared statement (reader)",
            "explain": "where each part of a query would run (reader)",
            "tables": "the tables, their distribution, shards and rows (reader)",
            "profile": "run a query; its answer, with where its time went (reader)",
            "drop_table": "drop a table (writer)",
        }
        described.update({a: f"cluster control: {a} (operator)" for a in CONTROL_ACTIONS})
        return list(described.items())

    @_plainly
    def do_action(
        self, context: flight.ServerCallContext, action: flight.Action
    ) -> Iterator[flight.Result]:
        kind = action.type
        body = action.body.to_pybytes() if action.body is not None else b""
        if len(body) > MAX_COMMAND_BYTES:
            raise pa.ArrowInvalid(f"action body of {len(body)} bytes is too large")
        needed = {**SQL_ACTIONS, **DATA_ACTIONS, **CONTROL_ACTIONS}.get(kind)
        if needed is None:
            raise pa.ArrowInvalid(
                f"unknown action {kind!r}; list_actions() names the ones this server has"
            )
        if kind in SQL_ACTIONS:
            principal = self._require(context, kind, needed)
            try:
                return iter(self._sql_action(principal, kind, body))
            except Exception as error:
                raise flight_error(error) from None
        arguments = _json_body(body)
        principal = self._require(context, kind, needed, arguments)
        started = time.perf_counter()
        try:
            answer = self._control(principal, kind, arguments)
        except Exception as error:
            if kind in CONTROL_ACTIONS:
                self.audit.record(
                    principal.name,
                    kind,
                    arguments,
                    f"error: {error}",
                    time.perf_counter() - started,
                )
            raise flight_error(error) from None
        if kind in CONTROL_ACTIONS:
            self.audit.record(principal.name, kind, arguments, "ok", time.perf_counter() - started)
        return iter([flight.Result(answer)])

    # -- statements ---------------------------------------------------------------------
    def _statement(
        self,
        context: flight.ServerCallContext,
        principal: Principal,
        query: str,
        stream: bool = False,
        parts: bool = False,
    ) -> pa.Table | pa.RecordBatchReader | _Parts:
        """Run one SQL statement: a SELECT (reader), or DROP TABLE, CREATE TABLE ... AS
        SELECT, INSERT INTO ... SELECT/VALUES, TRUNCATE (writer). One that reads the server's own
        state (its settings, files, databases, versions) needs an operator. With ``stream``
        a query's answer is read as it arrives (``db.stream``): never held here whole; with
        ``parts`` too (and ``flight_endpoints = "workers"``), its parts are reserved on the
        workers that hold them (``db.endpoints``) for the client to read from them."""
        tree, needs = self._needs_of(query)
        if tree is not None:
            shown = _server_state(tree, self._table_names)
        else:  # unparsable: any word of its that names the server's state counts
            found = _STATE_WORDS.search(query)
            shown = found[1].lower() if found else None
        if shown is not None:
            self._require(context, "server state", "operator", {"reads": shown})
        if isinstance(tree, exp.Grant | exp.Revoke):
            arguments = {"statement": query[:1000]}
            with self._audited(principal.name, tree.key, arguments):
                change = tree
                return self._checked(
                    principal, "grant", lambda: self.access.statement(principal, change)
                )
        listing = self.access.show(principal, query)
        if listing is not None:
            return listing
        if not changes_tables(query):
            self._check(principal, needs)
            if parts and self._from_workers:
                reserved = self.db.endpoints(
                    query, user=principal.name, credential=self._bearer(context), tls=self._tls
                )
                if reserved is not None:
                    return _Parts(*reserved)
            return self.db.stream(query) if stream else self.db.sql(query)
        self._require(context, "write statement", "writer", {"statement": query[:1000]})
        with self._audited(principal.name, "write statement", {"statement": query[:1000]}):
            if not isinstance(tree, exp.Drop):  # a drop needs OWNER: checked as it runs
                self._check(principal, needs)
            return self._write(principal, query)

    def _whole(
        self, context: flight.ServerCallContext, principal: Principal, query: str
    ) -> pa.Table:
        """Run one SQL statement (:meth:`_statement`), its answer whole."""
        answer = self._statement(context, principal, query)
        assert isinstance(answer, pa.Table)  # not streamed
        return answer

    @staticmethod
    def _bearer(context: flight.ServerCallContext) -> str:
        caller = context.get_middleware("auth")
        return str(caller.bearer) if caller is not None else ""

    def _check(self, principal: Principal, needs: Needs) -> None:
        """Refuse a statement whose tables ``principal`` may not reach (audited)."""
        self._checked(principal, "grants", lambda: self.access.check(principal, needs))

    def _checked(self, principal: Principal, what: str, call: Callable[[], R]) -> R:
        try:
            return call()
        except PermissionDeniedError as error:
            self.audit.record(principal.name, what, {}, f"denied: {error}", 0.0)
            self._count(what)
            raise

    def _owns(self, principal: Principal, name: str) -> None:
        """Refuse to drop or replace a table ``principal`` does not own (audited)."""
        self._check(principal, Needs((), name, grants.OWNER))

    def _write(self, principal: Principal, query: str) -> pa.Table:
        """A statement that changes tables, read as ``db.sql`` reads it
        (``sql/statements.py``), once its tables are checked: a drop needs OWNER, a table
        made here is its maker's; an INSERT runs as ``db.sql`` runs it."""
        change = statement_of(query)
        if isinstance(change, DropTable):
            if change.if_exists and change.name not in self.access.visible(principal):
                return pa.table({})
            self._owns(principal, change.name)
        if isinstance(change, CreateTableAs):
            rows = self.db.sql(change.query)
            self.db.create_table(change.name, rows, grants=self._owned_by(principal))
            self.access.forget()
            return pa.table({})
        answer = self.db.sql(query)
        self.access.forget()
        return answer

    def _needs_of(self, query: str) -> tuple[exp.Expr | None, Needs]:
        """``query`` parsed (None: SQLGlot cannot), and the tables it reads and writes."""
        tree = grants.parse(query)
        if tree is None:
            return None, grants.needs_of_text(query, self._table_names())
        return tree, grants.needs_of(tree)

    def _readable(self, principal: Principal, arguments: dict[str, Any]) -> str:
        """The action's query, once its tables are checked for ``principal``."""
        query: str = _arg(arguments, "query", str)
        self._check(principal, self._needs_of(query)[1])
        return query

    def _owned_by(self, principal: Principal) -> list[tuple[str, str, str]]:
        """The grants of a table ``principal`` makes: it is theirs, and no one else's."""
        return [(principal.name, grants.OWNER, principal.account_id)]

    def _table_names(self) -> list[str]:
        """The tables as the coordinator has them now (no call to any worker)."""
        return self.db.table_names()

    def _made_elsewhere(self, name: str) -> bool:
        """Whether a table ``name`` names under DuckDB's rule (another spelling of an
        existing table's name) exists."""
        try:
            self.db.schema(name)  # refreshes the snapshot where it lacks the table
        except UnknownTableError:
            return False
        return True

    # -- prepared statements ------------------------------------------------------------
    def _sql_action(self, principal: Principal, kind: str, body: bytes) -> list[flight.Result]:
        name, command = fsql.unpack(body)
        if kind == "ClosePreparedStatement":
            self._prepared_of(principal, command.prepared_statement_handle)
            self._prepared.take(command.prepared_statement_handle)
            return []
        if name != "ActionCreatePreparedStatementRequest":
            raise pa.ArrowInvalid(f"CreatePreparedStatement takes a request, not {name}")
        statement = _parse(command.query)
        placeholders = list(statement.find_all(exp.Placeholder, bfs=False))
        handle = secrets.token_bytes(16)
        self._prepared.put(handle, _Prepared(principal.name, command.query, placeholders))
        result = fsql.new("ActionCreatePreparedStatementResult", prepared_statement_handle=handle)
        return [flight.Result(fsql.pack(result))]

    def _prepared_of(self, principal: Principal, handle: bytes) -> _Prepared:
        prepared: _Prepared | None = self._prepared.take(handle, keep=True)
        if prepared is None or prepared.owner != principal.name:
            raise pa.ArrowKeyError("unknown prepared statement (closed, or not from this server)")
        return prepared

    def _bind(self, principal: Principal, handle: bytes, parameters: pa.Table) -> None:
        prepared = self._prepared_of(principal, handle)
        if parameters.num_columns != len(prepared.placeholders):
            raise QueryError(
                f"the statement has {len(prepared.placeholders)} parameter(s); "
                f"{parameters.num_columns} were bound"
            )
        prepared.parameters = parameters

    def _run_prepared(
        self, context: flight.ServerCallContext, principal: Principal, handle: bytes
    ) -> pa.Table:
        """Run a prepared statement once per row of its parameters, each checked as a
        statement sent as text is (a write needs ``writer``)."""
        prepared = self._prepared_of(principal, handle)
        if not prepared.placeholders:
            return self._whole(context, principal, prepared.query)
        if prepared.parameters is None or prepared.parameters.num_rows == 0:
            raise QueryError(
                f"the statement has {len(prepared.placeholders)} parameter(s) and none are bound"
            )
        columns = [column.to_pylist() for column in prepared.parameters.columns]
        answers = [
            self._whole(context, principal, _substitute(prepared, list(row)))
            for row in zip(*columns, strict=True)
        ]
        return pa.concat_tables(answers, promote_options="permissive")

    # -- bulk ingest --------------------------------------------------------------------
    def _ingest(
        self, principal: Principal, command: Any, reader: flight.MetadataRecordBatchReader
    ) -> int:
        """ADBC's ``adbc_ingest``: create and/or append, durable before the answer. The
        stream is read whole first (at most ``max_request_mb``), so a refused one keeps
        nothing; appends then go in chunks under ``<batch id>:<n>``, so a client that sends
        the same batch id again (option ``shardflow.batch_id``) has each row kept once."""
        name = command.table
        if command.temporary:
            raise QueryError("shardflow has no temporary tables")
        if command.catalog not in ("", CATALOG) or command.schema not in ("", SCHEMA):
            raise QueryError(f"tables live in {CATALOG}.{SCHEMA}")
        options = dict(command.options)
        batch_id = options.get("shardflow.batch_id") or secrets.token_hex(16)
        definition = command.table_definition_options
        exists = name in self._table_names() or self._made_elsewhere(name)
        if exists and definition.if_exists in (fsql.IF_EXISTS["FAIL"], 0):
            raise TableExistsError(
                f"table {name} exists (ingest mode 'create'): ingest with mode 'append' to add "
                "rows to it, 'replace' to replace it, or 'create_append' to do either"
            )
        if not exists and definition.if_not_exist != fsql.IF_NOT_EXIST["CREATE"]:
            raise UnknownTableError(
                f"Table {name} does not exist (ingest mode 'append'): ingest with mode "
                "'create' or 'create_append' to make it"
            )
        replace = exists and definition.if_exists == fsql.IF_EXISTS["REPLACE"]
        if replace:
            self._owns(principal, name)
        elif exists:
            self._check(principal, Needs((), name))
        table = self._read_bounded(reader)  # refused whole if too big: nothing kept
        if replace:
            self.db.drop_table(name)
            exists = False
        if not exists:  # all or nothing: the table appears whole, or not at all
            self.access.forget()
            return self.db.create_table(
                name,
                table,
                grants=self._owned_by(principal),
                distributed_by=options.get("shardflow.distributed_by") or None,
                replicated=options.get("shardflow.replicated", "").lower() == "true",
                colocate_with=options.get("shardflow.colocate_with") or None,
                key_index=options.get("shardflow.key_index", "").lower() == "true",
            )
        count, offset, part = 0, 0, 0
        rows_per_chunk = max(1, INGEST_CHUNK_BYTES * table.num_rows // max(1, table.nbytes))
        while offset < table.num_rows or part == 0:
            chunk = table.slice(offset, rows_per_chunk)
            count += self.db.insert(name, chunk, batch_id=f"{batch_id}:{part}")
            offset, part = offset + rows_per_chunk, part + 1
        return count

    def _read_bounded(self, reader: flight.MetadataRecordBatchReader) -> pa.Table:
        batches, total = [], 0
        for chunk in reader:
            if chunk.data is not None:
                total += chunk.data.nbytes
                self._check_size(total)
                batches.append(chunk.data)
        return pa.Table.from_batches(batches, schema=reader.schema)

    def _check_size(self, total: int) -> None:
        if total > self.options.max_request_bytes:
            raise QueryError(
                f"the ingest sends more than {self.options.max_request_bytes >> 20} MiB "
                "(setting max_request_mb); send it in several calls"
            )

    # -- metadata ------------------------------------------------------------------------
    def _metadata(self, principal: Principal, name: str, command: Any) -> pa.Table:
        if name == "CommandGetSqlInfo":
            return self._sql_info(list(command.info))
        if name == "CommandGetCatalogs":
            return pa.table({"catalog_name": [CATALOG]}, schema=fsql.CATALOGS_SCHEMA)
        if name == "CommandGetDbSchemas":
            keep = _matches(command.db_schema_filter_pattern, SCHEMA) and command.catalog in (
                "",
                CATALOG,
            )
            rows = {"catalog_name": [CATALOG], "db_schema_name": [SCHEMA]} if keep else None
            return pa.table(
                rows or {"catalog_name": [], "db_schema_name": []}, schema=fsql.DB_SCHEMAS_SCHEMA
            )
        if name == "CommandGetTables":
            return self._tables(principal, command)
        if name == "CommandGetTableTypes":
            return pa.table({"table_type": [TABLE_TYPE]}, schema=fsql.TABLE_TYPES_SCHEMA)
        if name == "CommandGetPrimaryKeys":
            return fsql.PRIMARY_KEYS_SCHEMA.empty_table()
        raise pa.ArrowNotImplementedError(f"Flight SQL {name} is not supported by shardflow")

    def _sql_info(self, wanted: list[int]) -> pa.Table:
        values: dict[int, str | bool | int] = {
            fsql.SERVER_NAME: "shardflow",
            fsql.SERVER_VERSION: version("shardflow"),
            fsql.SERVER_ARROW_VERSION: pa.__version__,
            fsql.SERVER_READ_ONLY: False,
            fsql.SERVER_SQL: True,
            fsql.SERVER_SUBSTRAIT: False,
            fsql.SERVER_CANCEL: False,
            fsql.SQL_DDL_CATALOG: False,
            fsql.SQL_DDL_SCHEMA: False,
            fsql.SQL_DDL_TABLE: True,
            fsql.SQL_IDENTIFIER_QUOTE_CHAR: '"',
        }
        if wanted:
            values = {k: v for k, v in values.items() if k in wanted}
        return fsql.sql_info_table(values)

    def _tables(self, principal: Principal, command: Any) -> pa.Table:
        """The tables ``principal`` may see (any privilege on them), as GetTables lists."""
        wanted_types = set(command.table_types)
        in_scope = (
            command.catalog in ("", CATALOG)
            and _matches(command.db_schema_filter_pattern, SCHEMA)
            and (not wanted_types or TABLE_TYPE in wanted_types)
        )
        names = [
            n
            for n in self.access.visible(principal)
            if in_scope and _matches(command.table_name_filter_pattern, n)
        ]
        columns: dict[str, list[Any]] = {
            "catalog_name": [CATALOG] * len(names),
            "db_schema_name": [SCHEMA] * len(names),
            "table_name": names,
            "table_type": [TABLE_TYPE] * len(names),
        }
        if not command.include_schema:
            return pa.table(columns, schema=fsql.TABLES_SCHEMA)
        columns["table_schema"] = [self.db.schema(n).serialize().to_pybytes() for n in names]
        return pa.table(columns, schema=fsql.TABLES_WITH_SCHEMA)

    # -- control and data actions ---------------------------------------------------------
    def _control(self, principal: Principal, kind: str, arguments: dict[str, Any]) -> bytes:
        cluster = self.db.cluster
        if kind == "explain":
            return _json(self.db.explain(self._readable(principal, arguments)))
        if kind == "tables":  # those the caller may see
            listed = self.db.tables()
            seen = pa.array(self.access.visible(principal), pa.string())
            return _ipc(listed.filter(pc.is_in(listed.column("name"), seen)))
        if kind == "profile":  # the answer, its profile in the schema's metadata
            answer, profile = self.db.profile(self._readable(principal, arguments))
            found = json.dumps(profile.to_json()).encode()
            return _ipc(answer.replace_schema_metadata({fsql.PROFILE_KEY: found}))
        if kind == "drop_table":
            name = _arg(arguments, "name", str)
            self._owns(principal, name)
            self.db.drop_table(name)
            self.access.forget()
            return _json(None)
        if kind == "migrate":
            record = cluster.migrate(_shard(arguments, "shard"), _arg(arguments, "to", str))
            return _json(record)
        if kind == "split":
            return _json(cluster.split(_shard(arguments, "shard")))
        if kind == "merge":
            return _json(cluster.merge(_shard(arguments, "first"), _shard(arguments, "second")))
        if kind == "cancel_drain":
            return _json(cluster.cancel_drain(_arg(arguments, "node", str)))
        if kind == "drain":
            deadline = float(arguments.get("deadline", 300.0))
            return _json(cluster.drain(_arg(arguments, "node", str), deadline))
        if kind == "drain_host":
            deadline = float(arguments.get("deadline", 300.0))
            return _json(cluster.drain_host(_arg(arguments, "ray_node_id", str), deadline))
        if kind == "rebalance":
            return _json(cluster.rebalance(bool(arguments.get("dry_run", True))))
        if kind == "cancel":
            return _json(cluster.cancel(_arg(arguments, "move_id", str)))
        if kind == "pause_balancer":
            return _json(cluster.pause_balancer())
        if kind == "resume_balancer":
            return _json(cluster.resume_balancer())
        if kind == "backup":  # a folder or URI the service's own process writes
            return _json(
                cluster.backup(
                    _arg(arguments, "to", str),
                    priority=str(arguments.get("priority", "idle")),
                    max_rate_mb_s=float(arguments.get("max_rate_mb_s", 0.0)),
                    keep_log=bool(arguments.get("keep_log", False)),
                )
            )
        if kind == "add_node":
            return _json(cluster.add_node())
        if kind == "nodes":
            return _json(cluster.nodes())
        if kind == "shards":
            return _ipc(cluster.shards())
        if kind == "migrations":
            return _json(cluster.migrations())
        if kind == "metrics_url":
            return _json(cluster.metrics_url())
        if kind == "settings":  # what the service runs with (they are set at its start)
            return _json(dataclasses.asdict(self.db.settings))
        raise pa.ArrowInvalid(f"unknown action {kind!r}")


# -- helpers ------------------------------------------------------------------------------
def _command(descriptor: flight.FlightDescriptor) -> tuple[str, Any]:
    if descriptor.descriptor_type != flight.DescriptorType.CMD or descriptor.command is None:
        raise pa.ArrowInvalid("shardflow takes Flight SQL commands, not paths")
    if len(descriptor.command) > MAX_COMMAND_BYTES:
        raise pa.ArrowInvalid(
            f"a command of {len(descriptor.command)} bytes is too large "
            f"(at most {MAX_COMMAND_BYTES}); send data by bulk ingest"
        )
    try:
        return fsql.unpack(descriptor.command)
    except fsql.MalformedCommand as error:
        raise pa.ArrowInvalid(str(error)) from None


@dataclass(frozen=True)
class _Parts:
    """An answer reserved in parts on the workers (``db.endpoints``)."""

    schema: pa.Schema
    parts: list[AnswerPart]


def _parts_info(descriptor: flight.FlightDescriptor, answer: _Parts) -> flight.FlightInfo:
    """A ``FlightInfo`` whose endpoints are the workers': each part's ticket, located at
    the worker that holds it (a client reads them at once, from each worker)."""
    endpoints = [flight.FlightEndpoint(p.ticket, [p.location]) for p in answer.parts]
    return flight.FlightInfo(answer.schema, descriptor, endpoints, -1, -1)


def _info(
    descriptor: flight.FlightDescriptor,
    schema: pa.Schema,
    ticket: bytes,
    answer: pa.Table | pa.RecordBatchReader,
) -> flight.FlightInfo:
    endpoint = flight.FlightEndpoint(ticket, [])
    if isinstance(answer, pa.RecordBatchReader):  # read as it arrives: its size is unknown
        return flight.FlightInfo(schema, descriptor, [endpoint], -1, -1)
    return flight.FlightInfo(schema, descriptor, [endpoint], answer.num_rows, answer.nbytes)


def _read(reader: pa.RecordBatchReader) -> Iterator[pa.RecordBatch]:
    """An answer read as it arrives, closed however its sending ends (a client that hangs
    up included): its parts stop being read."""
    try:
        yield from reader
    except Exception as error:  # said as the Flight error it maps to, as any call's
        raise flight_error(error) from None
    finally:
        reader.close()


def _close(answer: _Answer | None) -> None:
    """Stop reading an answer that is not fetched (expired, pushed out, never asked)."""
    if answer is not None and isinstance(answer.table, pa.RecordBatchReader):
        answer.table.close()


def _stream(table: pa.Table) -> flight.RecordBatchStream:
    """The answer as a stream of record batches of at most ``BATCH_BYTES`` each (clients
    refuse bigger gRPC messages: ADBC's limit is 16 MiB), cut lazily as they are sent."""
    rows = max(1, BATCH_BYTES * table.num_rows // max(1, table.nbytes))
    batches = (batch for chunk in table.to_batches() for batch in _cut(chunk, rows))
    return flight.RecordBatchStream(pa.RecordBatchReader.from_batches(table.schema, batches))


def _cut(batch: pa.RecordBatch, rows: int) -> Iterator[pa.RecordBatch]:
    for offset in range(0, batch.num_rows, rows):
        yield batch.slice(offset, rows)


def _update_result(count: int) -> bytes:
    # DoPut's answers travel as bare messages, not packed in Any as commands are
    return bytes(fsql.new("DoPutUpdateResult", record_count=count).SerializeToString())


def _matches(pattern: str, name: str) -> bool:
    """SQL LIKE (``%``, ``_``) as Flight SQL's filter patterns use it; empty matches all."""
    if not pattern:
        return True
    parts = (".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern)
    return re.fullmatch("".join(parts), name, re.DOTALL) is not None


def _substitute(prepared: _Prepared, values: list[Any]) -> str:
    """The statement with each placeholder replaced by its bound value as a literal
    (``?`` in order; ``$n`` by number), by position: parameter columns' names vary. The
    text was parsed when it was prepared: executions only splice values into it, so the
    plan of its shape is reused (see :func:`shardflow.sql.parameters.bind`)."""
    return bind(prepared.query, values)


STATE_PREFIXES = ("duckdb_", "pragma_")
SERVER_STATE = frozenset(
    {"current_setting", "getenv", "version", "which_secret", "pg_settings", "current_schemas"}
)
"""Functions and views that show the server's own state, beside every ``duckdb_*`` and
``pragma_*`` one (settings with their paths, attached databases, temporary files, secrets,
memory, library versions): an operator's only."""


def _server_state(tree: exp.Expr, tables: Callable[[], list[str]]) -> str | None:
    """The first function or view in the parsed statement that shows the server's own
    state, or None (SQL that does not parse is refused by its own error). A table of the
    cluster's (``tables``, asked only when needed) of such a name is the table."""
    for node in tree.walk():
        if isinstance(node, exp.CurrentVersion):
            return "version"
        if isinstance(node, exp.Anonymous) and _shows_server(node.name):
            return node.name.lower()
        if isinstance(node, exp.Table) and node.name and node.name.startswith(STATE_PREFIXES):
            if node.name not in tables():
                return node.name.lower()
    return None


_STATE_WORDS = re.compile(
    r"(?i)\b(duckdb_\w*|pragma_\w*|(?:current_setting|getenv|version|which_secret|pg_settings|"
    r"current_schemas)(?=\s*\())"
)


def _shows_server(name: str) -> bool:
    lowered = name.lower()
    return lowered.startswith(STATE_PREFIXES) or lowered in SERVER_STATE


def _parse(query: str) -> Any:
    try:
        return sqlglot.parse_one(query, read="duckdb")
    except sqlglot.errors.ParseError as error:
        raise SqlSyntaxError(str(error).splitlines()[0]) from None


def _json_body(body: bytes) -> dict[str, Any]:
    if not body:
        return {}
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise pa.ArrowInvalid("an action's body is a JSON object") from None
    if not isinstance(value, dict):
        raise pa.ArrowInvalid("an action's body is a JSON object")
    return value


def _arg(arguments: dict[str, Any], name: str, kind: type) -> Any:
    value = arguments.get(name)
    if not isinstance(value, kind):
        raise ConfigError(f"the action needs {name!r} ({kind.__name__})")
    return value


def _shard(arguments: dict[str, Any], name: str) -> str | int:
    value = arguments.get(name)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(f"the action needs {name!r}: a shard as 'table#unit' or a unit id")
    return value


def _json(value: Any) -> bytes:
    from dataclasses import asdict, is_dataclass

    def plain(item: Any) -> Any:
        if is_dataclass(item) and not isinstance(item, type):
            return asdict(item)
        if isinstance(item, list | tuple):
            return [plain(i) for i in item]
        return item

    return json.dumps(plain(value), default=str).encode()


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
