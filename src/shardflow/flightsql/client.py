"""A :class:`~shardflow.api.Database` over the network: ``shardflow.connect("grpc://...")``.

Every method is a Flight SQL call to ``shardflow serve``, under the caller's credentials:
the server checks the role each call needs, exactly as for any other Flight SQL client.
Errors come back as the shardflow error the server raised (same class, same message).
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq

from shardflow import errors
from shardflow.errors import AuthenticationError, ClosedError, ConfigError, Error
from shardflow.flightsql import wire as fsql
from shardflow.records import BackupInfo, MigrationRecord, NodeInfo
from shardflow.sql.parameters import bind
from shardflow.telemetry.profile import QueryProfile

T = TypeVar("T")
_NAMED = re.compile(r"\b([A-Z][A-Za-z]*Error): (.*)", re.DOTALL)
_NAME = re.compile(r"\b([A-Z][A-Za-z]*): ")
"""A class name before its message, as the service says an error (``MoveCancelled: ...``)."""
_DETAIL = re.compile(r"\. Detail: .*$|\. gRPC client debug context: .*$", re.DOTALL)


def _error(error: Exception) -> Exception:
    """The shardflow error a Flight error carries (its name and message), else a
    ClusterError with the Flight message."""
    text = _DETAIL.sub("", str(error))
    if isinstance(error, flight.FlightUnauthenticatedError):
        found = _NAMED.search(text)
        return AuthenticationError(found.group(2) if found else text)
    for found in _NAME.finditer(text):  # the first name that is one of shardflow's errors
        kind = getattr(errors, found.group(1), None)
        if isinstance(kind, type) and issubclass(kind, Error) and kind is not Error:
            try:
                return kind(text[found.end() :].strip())
            except TypeError:
                break
    if isinstance(error, flight.FlightUnavailableError):
        return errors.ClusterError(f"the service is unreachable: {text}")
    return errors.ClusterError(text)


UNREACHABLE = ("Connection refused", "Socket closed", "Connection reset", "failed to connect")
"""What gRPC says when the door a call went to is gone (besides FlightUnavailableError)."""


def _unreachable(error: Exception) -> bool:
    """Whether ``error`` says the service's door is gone, not that the call failed there."""
    if isinstance(error, flight.FlightUnavailableError):
        return True
    return isinstance(error, flight.FlightError) and any(t in str(error) for t in UNREACHABLE)


def doors(uri: str) -> list[str]:
    """The addresses of ``"grpc://a:1,grpc://b:2"`` (or ``"grpc://a:1,b:2"``: the first
    one's scheme for the rest)."""
    parts = [p.strip() for p in uri.split(",")]
    if not all(parts):
        raise ConfigError(f"an empty address in {uri!r}")
    scheme = parts[0].split("://", 1)[0]
    return [p if "://" in p else f"{scheme}://{p}" for p in parts]


class RemoteCluster:
    """``db.cluster`` of a served cluster: control actions (role ``operator``)."""

    def __init__(self, db: RemoteDatabase) -> None:
        self._db = db

    def migrate(self, shard: str | int, to: str) -> MigrationRecord:
        return self._record(self._db._action("migrate", {"shard": shard, "to": to}))

    def split(self, shard: str | int) -> MigrationRecord:
        return self._record(self._db._action("split", {"shard": shard}))

    def merge(self, first: str | int, second: str | int) -> MigrationRecord:
        return self._record(self._db._action("merge", {"first": first, "second": second}))

    def drain(self, node: str, deadline: float = 300.0) -> list[MigrationRecord]:
        moved = self._db._action("drain", {"node": node, "deadline": deadline})
        return [self._record(r) for r in moved]

    def drain_host(self, ray_node_id: str, deadline: float = 300.0) -> list[MigrationRecord]:
        arguments = {"ray_node_id": ray_node_id, "deadline": deadline}
        return [self._record(r) for r in self._db._action("drain_host", arguments)]

    def cancel(self, move_id: str) -> MigrationRecord:
        return self._record(self._db._action("cancel", {"move_id": move_id}))

    def cancel_drain(self, node: str) -> bool:
        return bool(self._db._action("cancel_drain", {"node": node}))

    def pause_balancer(self) -> bool:
        return bool(self._db._action("pause_balancer", {}))

    def resume_balancer(self) -> bool:
        return bool(self._db._action("resume_balancer", {}))

    def rebalance(self, dry_run: bool = True) -> dict[str, Any]:
        plan: dict[str, Any] = self._db._action("rebalance", {"dry_run": dry_run})
        return plan

    def backup(
        self,
        to: str,
        *,
        priority: str = "idle",
        max_rate_mb_s: float = 0.0,
        keep_log: bool = False,
    ) -> BackupInfo:
        """A backup into ``to``, a folder or URI the service's process writes."""
        asked = {
            "to": to,
            "priority": priority,
            "max_rate_mb_s": max_rate_mb_s,
            "keep_log": keep_log,
        }
        return BackupInfo.from_dict(self._db._action("backup", asked))

    def add_node(self) -> str:
        node: str = self._db._action("add_node", {})
        return node

    def migrations(self) -> list[MigrationRecord]:
        return [self._record(r) for r in self._db._action("migrations", {})]

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(**n) for n in self._db._action("nodes", {})]

    def settings(self) -> dict[str, Any]:
        """The settings the service runs with (operator)."""
        settings: dict[str, Any] = self._db._action("settings", {})
        return settings

    def metrics_url(self) -> str:
        url: str = self._db._action("metrics_url", {})
        return url

    def shards(self) -> pa.Table:
        return self._db._action_table("shards", {})

    @staticmethod
    def _record(data: dict[str, Any]) -> MigrationRecord:
        return MigrationRecord.from_dict(data)


class RemoteDatabase:
    """A connection to ``shardflow serve`` over Arrow Flight SQL, with the methods of a
    local :class:`~shardflow.api.Database` (``sql``, ``explain``, ``tables``,
    ``create_table``, ``insert``, ``drop_table``, ``cluster.*``). Use as a context manager,
    or call ``close()``."""

    def __init__(
        self,
        uri: str,
        *,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
    ) -> None:
        if (user is None) == (token is None):
            raise ConfigError("give user= and password=, or token= (a service token)")
        if user is not None and not password:
            raise ConfigError("user= needs password=")
        self.uri = uri
        self.addresses = doors(uri)
        """The service's replicas, tried in turn: when the one in use stops answering, a
        call goes on at the next (``"grpc://a:8815,grpc://b:8815"``)."""
        self.last_report = None
        self._user, self._password, self._token = user, password, token
        self._tls: dict[str, Any] = {}
        if tls_root_certs is not None:
            self._tls["tls_root_certs"] = tls_root_certs
        self._client: flight.FlightClient | None = None
        self._workers: dict[str, flight.FlightClient] = {}
        """Clients of the workers' endpoints, by location (``_endpoint_client``)."""
        self._workers_lock = threading.Lock()
        self._at = 0
        self._connect()
        self.cluster = RemoteCluster(self)

    def _open(self, address: str) -> tuple[flight.FlightClient, flight.FlightCallOptions]:
        """A client of one door, signed in."""
        client = flight.FlightClient(address, **self._tls)
        try:
            if self._token is not None:
                header = (b"authorization", f"Bearer {self._token}".encode())
                options = flight.FlightCallOptions(headers=[header])
                client.get_flight_info(
                    flight.FlightDescriptor.for_command(fsql.pack(fsql.new("CommandGetCatalogs"))),
                    options,
                )
            else:
                assert self._user is not None and self._password is not None
                header = client.authenticate_basic_token(self._user, self._password)
                options = flight.FlightCallOptions(headers=[header])
        except BaseException:
            client.close()
            raise
        return client, options

    def _connect(self) -> None:
        """Sign in at the first door that answers, from the one in use on; a refused
        sign-in is said at once (every door has the same accounts)."""
        failure: Exception | None = None
        for step in range(len(self.addresses)):
            at = (self._at + step) % len(self.addresses)
            try:
                self._client, self._options = self._open(self.addresses[at])
            except flight.FlightUnauthenticatedError as error:
                raise _error(error) from None
            except (flight.FlightError, pa.ArrowException) as error:
                failure = error
                continue
            self._at = at
            return
        assert failure is not None
        raise _error(failure) from None

    def _call(self, call: Callable[[flight.FlightClient], T]) -> T:
        """``call`` at the door in use; if that door is gone, once more at the next one
        that answers (an insert carries a batch id: it lands once either way)."""
        client = self._client
        if client is None:
            raise ClosedError("the connection is closed; call shardflow.connect() again")
        try:
            return call(client)
        except (flight.FlightError, pa.ArrowException) as error:
            if len(self.addresses) == 1 or not _unreachable(error):
                raise _error(error) from None
        self._at += 1  # the door in use is gone: the next one
        client.close()
        self._connect()
        assert self._client is not None
        try:
            return call(self._client)
        except (flight.FlightError, pa.ArrowException) as error:
            raise _error(error) from None

    def _fetch(self, command: Any) -> pa.Table:
        descriptor = flight.FlightDescriptor.for_command(fsql.pack(command))

        def fetch(client: flight.FlightClient) -> pa.Table:
            for attempt in range(2):  # an answer cut off as the cluster changed: once more
                info = client.get_flight_info(descriptor, self._options)
                try:
                    parts = self._read_endpoints(client, info)
                except Exception as error:
                    if attempt == 0 and isinstance(_error(error), errors.AnswerInterrupted):
                        continue
                    raise
                return pa.concat_tables(parts) if len(parts) != 1 else parts[0]
            raise AssertionError("unreachable")  # pragma: no cover

        return self._call(fetch)

    def _read_endpoints(
        self, client: flight.FlightClient, info: flight.FlightInfo
    ) -> list[pa.Table]:
        """Every endpoint of ``info`` read, in order: at the service, or (parts of an answer
        read straight from the workers, ``flight_endpoints = "workers"``) at each worker's
        location, all at once."""
        endpoints = list(info.endpoints)
        if len(endpoints) == 1:
            return [self._read_endpoint(client, endpoints[0])]
        with ThreadPoolExecutor(len(endpoints), thread_name_prefix="shardflow-part") as pool:
            return list(pool.map(partial(self._read_endpoint, client), endpoints))

    def _read_endpoint(
        self, client: flight.FlightClient, endpoint: flight.FlightEndpoint
    ) -> pa.Table:
        at = self._endpoint_client(client, endpoint)
        try:
            return at.do_get(endpoint.ticket, self._options).read_all()
        except flight.FlightUnavailableError as error:
            if at is client:
                raise
            raise flight.FlightUnavailableError(
                f"AnswerInterrupted: the worker at {endpoint.locations[0].uri.decode()} went "
                f"away while its part of the answer was read ({_DETAIL.sub('', str(error))}); "
                "run the query again"
            ) from None

    def _endpoint_client(
        self, client: flight.FlightClient, endpoint: flight.FlightEndpoint
    ) -> flight.FlightClient:
        """The client that reads ``endpoint``: the service's, or one of the worker's
        location it names (kept for the next answer)."""
        if not endpoint.locations:
            return client
        location = endpoint.locations[0].uri.decode()
        with self._workers_lock:
            found = self._workers.get(location)
            if found is None:
                found = self._workers[location] = flight.FlightClient(location, **self._tls)
            return found

    def _action_bytes(self, kind: str, arguments: dict[str, Any]) -> bytes:
        action = flight.Action(kind, json.dumps(arguments).encode())

        def act(client: flight.FlightClient) -> bytes:
            results = list(client.do_action(action, self._options))
            return results[0].body.to_pybytes() if results else b"null"

        return self._call(act)

    def _action(self, kind: str, arguments: dict[str, Any]) -> Any:
        return json.loads(self._action_bytes(kind, arguments))

    def _action_table(self, kind: str, arguments: dict[str, Any]) -> pa.Table:
        return pa.ipc.open_stream(self._action_bytes(kind, arguments)).read_all()

    # -- the Database methods ---------------------------------------------------------
    def sql(self, query: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run a statement on the server and return its answer (``params`` as
        :meth:`shardflow.Database.sql` takes them)."""
        if params is not None:
            query = bind(query, params)
        return self._fetch(fsql.new("CommandStatementQuery", query=query))

    def stream(self, query: str, params: Sequence[Any] | None = None) -> pa.RecordBatchReader:
        """Run a query on the server and read its answer as it arrives (as
        :meth:`shardflow.Database.stream`; an answer cut off raises ``AnswerInterrupted``)."""
        if params is not None:
            query = bind(query, params)
        command = fsql.pack(fsql.new("CommandStatementQuery", query=query))
        descriptor = flight.FlightDescriptor.for_command(command)

        def start(client: flight.FlightClient) -> tuple[flight.FlightClient, flight.FlightInfo]:
            return client, client.get_flight_info(descriptor, self._options)

        client, info = self._call(start)

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                for endpoint in info.endpoints:
                    at = self._endpoint_client(client, endpoint)
                    for chunk in at.do_get(endpoint.ticket, self._options):
                        yield chunk.data
            except (flight.FlightError, pa.ArrowException) as error:
                raise _error(error) from None

        return pa.RecordBatchReader.from_batches(info.schema, batches())

    def explain(self, query: str) -> str:
        text: str = self._action("explain", {"query": query})
        return text

    def tables(self) -> pa.Table:
        return self._action_table("tables", {})

    def profile(self, query: str) -> tuple[pa.Table, QueryProfile]:
        """Run a query on the server; its answer, and where its time went there."""
        answer = self._action_table("profile", {"query": query})
        found = (answer.schema.metadata or {}).get(fsql.PROFILE_KEY)
        if found is None:
            raise errors.ClusterError("the service sent no profile with the answer")
        profile = QueryProfile.from_json(json.loads(found))
        return answer.replace_schema_metadata(None), profile

    def create_table(
        self,
        name: str,
        source: object,
        *,
        distributed_by: str | None = None,
        replicated: bool = False,
        colocate_with: str | None = None,
        key_index: bool = False,
        progress: bool = False,
    ) -> int:
        """Create a table from a ``pyarrow.Table``, an Arrow stream or a Parquet file on this
        machine (read here, sent by bulk ingest); all or nothing, as locally."""
        options = {"shardflow.replicated": str(replicated).lower()}
        if distributed_by:
            options["shardflow.distributed_by"] = distributed_by
        if colocate_with:
            options["shardflow.colocate_with"] = colocate_with
        if key_index:
            options["shardflow.key_index"] = "true"
        return self._ingest(name, _as_table(source), "create", options)

    def insert(
        self, name: str, data: pa.Table | pa.RecordBatch, *, batch_id: str | None = None
    ) -> int:
        """Append rows, durable before this returns; the same ``batch_id`` again keeps
        each row once."""
        # a batch id of its own, so that an insert sent again at another door lands once
        options = {"shardflow.batch_id": batch_id or uuid.uuid4().hex}
        return self._ingest(name, _as_table(data), "append", options)

    def drop_table(self, name: str) -> None:
        self._action("drop_table", {"name": name})

    def grants(self, table: str | None = None) -> pa.Table:
        """``SHOW GRANTS [ON table]``: the grants this account may see (an operator: all;
        a table's owner: all of that table's; others: those to PUBLIC, to roles and to
        themselves)."""
        return self.sql("SHOW GRANTS" if table is None else f"SHOW GRANTS ON {_quoted(table)}")

    def grant(self, table: str, privileges: str | Sequence[str], to: str) -> None:
        """``GRANT privileges ON table TO to`` (the table's owner or an operator)."""
        self.sql(f"GRANT {_privileges(privileges)} ON {_quoted(table)} TO {_quoted(to)}")

    def revoke(self, table: str, privileges: str | Sequence[str], from_: str) -> None:
        """``REVOKE privileges ON table FROM from_`` (the table's owner or an operator)."""
        self.sql(f"REVOKE {_privileges(privileges)} ON {_quoted(table)} FROM {_quoted(from_)}")

    def _ingest(self, name: str, table: pa.Table, mode: str, options: dict[str, str]) -> int:
        command = fsql.new("CommandStatementIngest", table=name)
        definition = command.table_definition_options
        definition.if_not_exist = fsql.IF_NOT_EXIST["CREATE" if mode == "create" else "FAIL"]
        definition.if_exists = fsql.IF_EXISTS["FAIL" if mode == "create" else "APPEND"]
        command.options.update(options)
        descriptor = flight.FlightDescriptor.for_command(fsql.pack(command))

        def put(client: flight.FlightClient) -> int:
            writer, metadata = client.do_put(descriptor, table.schema, self._options)
            with writer:
                writer.write_table(table)
                writer.done_writing()
                answer = metadata.read()
            if answer is None:
                return int(table.num_rows)
            result = fsql.new("DoPutUpdateResult")
            result.ParseFromString(answer.to_pybytes())
            return int(result.record_count)

        return self._call(put)

    # -- life cycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection (the service keeps running). Safe to call twice."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        with self._workers_lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.close()

    def __enter__(self) -> RemoteDatabase:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _as_table(source: object) -> pa.Table:
    if isinstance(source, pa.RecordBatch):
        return pa.Table.from_batches([source])
    if isinstance(source, pa.Table):
        return source
    if isinstance(source, str | os.PathLike):
        return pq.read_table(os.fspath(source))
    if hasattr(source, "__arrow_c_stream__"):  # a RecordBatchReader, DuckDB, Polars, ...
        try:
            return pa.RecordBatchReader.from_stream(source).read_all()
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise ConfigError(f"cannot read an Arrow stream from the source: {error}") from None
    raise ConfigError(
        f"send a pyarrow.Table, an Arrow stream or a Parquet path, not {type(source).__name__}"
    )


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _privileges(privileges: str | Sequence[str]) -> str:
    words = [privileges] if isinstance(privileges, str) else list(privileges)
    if not words or not all(w.replace(" ", "").isalpha() for w in words):
        raise errors.ConfigError(f"privileges are words such as SELECT or ALL, not {words!r}")
    return ", ".join(words)
