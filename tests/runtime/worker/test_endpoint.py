"""A worker's Flight endpoint (``runtime/worker/endpoint.py``) over real in-process workers
(real DuckDB shards, real files) and a real ``pyarrow.flight`` client: a part reserved on
each worker is read once, by the caller it was reserved for, and the parts together are
DuckDB's answer; a forged, used, expired or other caller's ticket is refused and audited;
the shards of a reserved part stay readable while a move takes their unit away, and are
let go once it is read or expires."""

from __future__ import annotations

import gc
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import duckdb
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from shardflow.audit import AuditLog
from shardflow.config import Settings
from shardflow.engine import duckdb_engine
from shardflow.errors import ConfigError
from shardflow.runtime.fastlane import Lanes, LaneServer
from shardflow.runtime.protocol import PartRequest, credential_digest
from shardflow.runtime.worker.endpoint import PartEndpoint
from tests.support.local_cluster import LocalCluster, events

ROWS = 6_000
QUERY = "SELECT id, pad FROM events WHERE id % 3 = 1"
NODES = ("node-0", "node-1")


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data", nodes=2)
    local.create_table("events", events(0, ROWS), "id")
    yield local
    local.close()


@pytest.fixture()
def endpoints(cluster: LocalCluster, tmp_path: Path) -> Iterator[dict[str, PartEndpoint]]:
    served = {
        node: PartEndpoint(cluster.workers.get(node).node, "127.0.0.1", node, audit(tmp_path))
        for node in NODES
    }
    yield served
    for endpoint in served.values():
        endpoint.close()


def audit(tmp_path: Path) -> AuditLog:
    return AuditLog(tmp_path / "home")


def refusals(tmp_path: Path) -> list[tuple[str, str]]:
    """(who, outcome) of every ticket an endpoint refused, from the audit log."""
    path = tmp_path / "home" / "audit" / "audit.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    entries = [json.loads(line) for line in lines]
    return [(e["who"], e["outcome"]) for e in entries if e["action"] == "read endpoint"]


def units_on(cluster: LocalCluster, node: str) -> list[int]:
    return sorted(u.unit_id for u in cluster.units("events") if u.node == node)


def reserve(
    cluster: LocalCluster,
    endpoint: PartEndpoint,
    node: str,
    credential: str = "alice-token",
    ttl_s: float = 60.0,
) -> bytes:
    units = units_on(cluster, node)
    assert units, f"{node} holds no unit of events"
    schema = cluster.sql(QUERY).schema
    return endpoint.reserve(
        PartRequest(
            QUERY, {"events": units}, cluster.catalog.epoch, {}, schema, "alice",
            credential_digest(credential), ttl_s,
        )
    )  # fmt: skip


def read(endpoint: PartEndpoint, ticket: bytes, credential: str = "alice-token") -> pa.Table:
    client = flight.FlightClient(endpoint.location)
    header = (b"authorization", f"Bearer {credential}".encode())
    try:
        return client.do_get(
            flight.Ticket(ticket), flight.FlightCallOptions(headers=[header])
        ).read_all()
    finally:
        client.close()


def oracle() -> list[int]:
    con = duckdb.connect()
    con.register("events", events(0, ROWS))
    ids = con.sql(QUERY).to_arrow_table().column("id").to_pylist()
    con.close()
    return sorted(ids)


def test_the_parts_read_from_each_worker_are_duckdbs_answer(
    cluster: LocalCluster, endpoints: dict[str, PartEndpoint]
) -> None:
    parts = [read(endpoints[n], reserve(cluster, endpoints[n], n)) for n in NODES]
    assert all(part.num_rows > 0 for part in parts)  # each worker gave its own share
    assert sorted(pa.concat_tables(parts).column("id").to_pylist()) == oracle()
    assert parts[0].schema == cluster.sql(QUERY).schema
    assert all(e.reserved == 0 for e in endpoints.values())


def test_forged_used_expired_and_other_callers_tickets_are_refused_and_audited(
    cluster: LocalCluster, endpoints: dict[str, PartEndpoint], tmp_path: Path
) -> None:
    endpoint = endpoints["node-0"]
    ticket = reserve(cluster, endpoint, "node-0")
    forged = ticket[:-4] + (b"AAAA" if not ticket.endswith(b"AAAA") else b"BBBB")
    with pytest.raises(flight.FlightUnauthorizedError, match="did not sign"):
        read(endpoint, forged)
    with pytest.raises(flight.FlightUnauthorizedError, match="another caller"):
        read(endpoint, ticket, credential="mallory-token")
    assert read(endpoint, ticket).num_rows > 0  # still its caller's, after those
    with pytest.raises(flight.FlightUnauthorizedError, match="read already"):
        read(endpoint, ticket)

    short = reserve(cluster, endpoint, "node-0", ttl_s=0.2)
    time.sleep(0.3)
    with pytest.raises(flight.FlightUnauthorizedError, match="expired"):
        read(endpoint, short)

    outcomes = refusals(tmp_path)
    assert [who for who, _ in outcomes] == ["?", "alice", "alice", "alice"]
    assert all(outcome.startswith("refused: ") for _, outcome in outcomes)


def test_a_reserved_part_is_read_whole_after_its_unit_moved_away(
    cluster: LocalCluster, endpoints: dict[str, PartEndpoint]
) -> None:
    ticket = reserve(cluster, endpoints["node-0"], "node-0")
    before = read(endpoints["node-1"], reserve(cluster, endpoints["node-1"], "node-1"))
    moved = units_on(cluster, "node-0")
    for unit in moved:
        cluster.migrate(unit, "node-1")
    assert units_on(cluster, "node-0") == []
    worker = cluster.workers.get("node-0").node
    assert worker.shards == {} or all(k[0] != "events" for k in worker.shards)

    part = read(endpoints["node-0"], ticket)  # the moved shards were kept for it
    ids = sorted(pa.concat_tables([part, before]).column("id").to_pylist())
    assert ids == oracle()
    assert worker.readers.total() == 0 and worker._releasing == []  # let go once read


def test_a_reservation_that_expires_unread_lets_its_shards_go(
    cluster: LocalCluster, endpoints: dict[str, PartEndpoint]
) -> None:
    endpoint = endpoints["node-0"]
    reserve(cluster, endpoint, "node-0", ttl_s=30)
    worker = cluster.workers.get("node-0").node
    assert worker.readers.total() > 0
    for unit in units_on(cluster, "node-0"):
        cluster.migrate(unit, "node-1")
    assert worker._releasing, "the moved shards wait for the reserved part's read"
    assert endpoint.expire(now=time.time() + 31) == 1
    assert worker.readers.total() == 0 and worker._releasing == []


def no_fragment(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("no fragment runs over this lane")


def test_a_reservation_cancelled_over_the_lane_lets_its_shards_go_at_once(
    cluster: LocalCluster, endpoints: dict[str, PartEndpoint]
) -> None:
    """Another worker's part of the same answer failed: the session cancels this one over
    the worker's lane (a real lane server and client), and the shards a move took away
    go without waiting for the ticket's expiry; the ticket reads nothing after."""
    endpoint = endpoints["node-0"]
    ticket = reserve(cluster, endpoint, "node-0", ttl_s=30)
    worker = cluster.workers.get("node-0").node
    for unit in units_on(cluster, "node-0"):
        cluster.migrate(unit, "node-1")
    assert worker._releasing, "the moved shards wait for the reserved part"
    server = LaneServer(
        no_fragment, "127.0.0.1", "node-0", reserve=endpoint.reserve,
        endpoint=endpoint.location, cancel=endpoint.cancel,
    )  # fmt: skip
    lanes = Lanes()
    try:
        forged = ticket[:-4] + b"AAAA"
        assert lanes.cancel(server.address, forged) is False  # not its signature
        assert lanes.cancel(server.address, ticket) is True
        assert lanes.cancel(server.address, ticket) is False  # let go already
    finally:
        lanes.close()
        server.close()
    assert endpoint.reserved == 0
    assert worker.readers.total() == 0 and worker._releasing == []
    with pytest.raises(flight.FlightUnauthorizedError, match="read already"):
        read(endpoint, ticket)


def test_a_part_whose_stream_is_dropped_unread_lets_its_shards_go(
    cluster: LocalCluster, endpoints: dict[str, PartEndpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks a part and hangs up before its first batch: the stream is dropped
    unread, and the part's reading stops and lets its shards go (a leak held them). The
    engine's batches are made small, so that the part is more than the endpoint queues."""
    monkeypatch.setattr(duckdb_engine, "ARROW_BATCH_ROWS", 50)
    endpoint = endpoints["node-0"]
    reserve(cluster, endpoint, "node-0")
    worker = cluster.workers.get("node-0").node
    [reservation] = endpoint._reserved.values()
    endpoint._reserved.clear()  # taken, as a DoGet takes it
    batches = endpoint._parts(reservation)
    del batches
    gc.collect()
    deadline = time.monotonic() + 10
    while worker.readers.total() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.readers.total() == 0


def test_a_fixed_port_is_listened_on_and_a_taken_one_refused_with_the_setting_named(
    cluster: LocalCluster,
) -> None:
    """``endpoint_port``: the port a NetworkPolicy names. Taken (a second worker on the
    host), the worker says which setting to change instead of failing later."""
    node = cluster.workers.get("node-0").node
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="endpoint_port"):
            PartEndpoint(node, "127.0.0.1", "node-0", port=port)
    endpoint = PartEndpoint(node, "127.0.0.1", "node-0", port=port)  # free again
    try:
        assert endpoint.location == f"grpc+tcp://127.0.0.1:{port}"
        ticket = reserve(cluster, endpoint, "node-0")
        assert read(endpoint, ticket).num_rows > 0
    finally:
        endpoint.close()
    with pytest.raises(ConfigError, match="endpoint_port must be a port"):
        Settings(endpoint_port=70_000)
