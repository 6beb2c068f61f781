"""Answers read straight from the workers (``flight_endpoints = "workers"``): a real
``shardflow serve`` answers a scan with one endpoint per worker, located at the workers'
own Flight ports; ADBC's driver, ``pyarrow.flight`` and ``shardflow.connect`` read them
(answers equal DuckDB's); another user's ticket is refused by the worker and audited; a
service with TLS gets endpoints that speak TLS with its certificate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import adbc_driver_flightsql.dbapi as flight_sql
import duckdb
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import shardflow
from shardflow.flightsql import wire as fsql
from tests.service.conftest import (
    PASSWORDS,
    Served,
    add_users,
    sample_table,
    self_signed,
    start_service,
)

pytestmark = pytest.mark.cluster
ROWS = 60_000
SCAN = "SELECT id, g, s FROM t WHERE g <> 3"


@pytest.fixture(scope="module")
def parted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A service reading answers from its two workers, over a table in units on both."""
    data_dir = tmp_path_factory.mktemp("parted")
    add_users(data_dir)
    with shardflow.connect(workers=2, data_dir=data_dir, initial_shard_bytes=64 << 10) as db:
        db.create_table("t", sample_table(ROWS), distributed_by="id")
        db.grant("t", "SELECT", "reader")
    service = start_service(data_dir, "--set", "flight_endpoints=workers")
    yield service
    assert service.stop() == 0, "".join(service.output[-50:])


def oracle(query: str) -> list[tuple[object, ...]]:
    con = duckdb.connect()
    con.register("t", sample_table(ROWS))
    rows = sorted(con.sql(query).fetchall())
    con.close()
    return rows


def sorted_rows(table: pa.Table) -> list[tuple[object, ...]]:
    return sorted(zip(*(c.to_pylist() for c in table.columns), strict=True))


def signed_in(served: Served, user: str) -> tuple[flight.FlightClient, flight.FlightCallOptions]:
    client = flight.FlightClient(served.uri)
    header = client.authenticate_basic_token(user, PASSWORDS[user])
    return client, flight.FlightCallOptions(headers=[header])


def flight_info(
    served: Served,
    user: str,
    query: str,
    signed: tuple[flight.FlightClient, flight.FlightCallOptions] | None = None,
) -> flight.FlightInfo:
    """``query``'s FlightInfo, asked by ``user`` (signed in anew, or as ``signed``)."""
    client, options = signed or signed_in(served, user)
    command = fsql.pack(fsql.new("CommandStatementQuery", query=query))
    return client.get_flight_info(flight.FlightDescriptor.for_command(command), options)


def test_a_scan_is_answered_with_an_endpoint_at_each_worker(parted: Served) -> None:
    info = flight_info(parted, "alice", SCAN)
    locations = {e.locations[0].uri.decode() for e in info.endpoints if e.locations}
    assert len(info.endpoints) == 2 and len(locations) == 2  # one part per worker
    assert parted.uri.rsplit(":", 1)[1] not in {loc.rsplit(":", 1)[1] for loc in locations}
    merged = flight_info(parted, "alice", "SELECT g, count(*) AS n FROM t GROUP BY g")
    assert [e.locations for e in merged.endpoints] == [[]]  # finished in one place: the service


def test_adbc_pyarrow_and_shardflow_read_the_parts_from_the_workers(parted: Served) -> None:
    expected = oracle(SCAN)
    with flight_sql.connect(
        parted.uri, db_kwargs={"username": "alice", "password": PASSWORDS["alice"]},
        autocommit=True,
    ) as conn, conn.cursor() as cur:  # fmt: skip
        cur.execute(SCAN)
        assert sorted_rows(cur.fetch_arrow_table()) == expected

    client, options = signed_in(parted, "alice")
    info = flight_info(parted, "alice", SCAN, (client, options))
    parts = [
        flight.FlightClient(e.locations[0]).do_get(e.ticket, options).read_all()
        for e in info.endpoints
    ]
    assert sorted_rows(pa.concat_tables(parts)) == expected
    client.close()

    with shardflow.connect(parted.uri, user="bob", password=PASSWORDS["bob"]) as db:
        assert sorted_rows(db.sql(SCAN)) == expected
        assert sorted_rows(db.stream(SCAN).read_all()) == expected


def test_another_users_ticket_is_refused_by_the_worker_and_audited(parted: Served) -> None:
    info = flight_info(parted, "alice", SCAN)
    _, bobs = signed_in(parted, "bob")
    endpoint = info.endpoints[0]
    worker = flight.FlightClient(endpoint.locations[0])
    with pytest.raises(flight.FlightUnauthorizedError, match="another caller's ticket"):
        worker.do_get(endpoint.ticket, bobs).read_all()
    _, alices = signed_in(parted, "alice")  # a new login: another bearer token, refused too
    with pytest.raises(flight.FlightUnauthorizedError, match="another caller's ticket"):
        worker.do_get(endpoint.ticket, alices).read_all()
    worker.close()

    log = parted.data_dir / "audit" / "audit.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    refused = [e for e in entries if e["action"] == "read endpoint"]
    assert len(refused) >= 2 and all(e["who"] == "alice" for e in refused)
    assert all(e["outcome"] == "refused: another caller's ticket" for e in refused)


def test_with_tls_the_workers_endpoints_speak_tls_with_the_services_certificate(
    tmp_path: Path,
) -> None:
    cert, key = self_signed(tmp_path)
    data_dir = tmp_path / "data"
    add_users(data_dir)
    with shardflow.connect(workers=2, data_dir=data_dir, initial_shard_bytes=64 << 10) as db:
        db.create_table("t", sample_table(ROWS), distributed_by="id")
        db.grant("t", "SELECT", "reader")
    service = start_service(
        data_dir,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--set",
        "flight_endpoints=workers",
    )
    try:
        roots = cert.read_bytes()
        client = flight.FlightClient(service.uri, tls_root_certs=roots)
        options = flight.FlightCallOptions(
            headers=[client.authenticate_basic_token("alice", PASSWORDS["alice"])]
        )
        info = flight_info(service, "alice", SCAN, (client, options))
        locations = [e.locations[0].uri.decode() for e in info.endpoints]
        assert len(locations) == 2 and all(loc.startswith("grpc+tls://") for loc in locations)
        plain = flight.FlightClient(locations[0].replace("grpc+tls://", "grpc+tcp://"))
        with pytest.raises(flight.FlightError):  # no plain gRPC at a worker's endpoint
            plain.do_get(info.endpoints[0].ticket, options).read_all()
        plain.close()
        client.close()

        with flight_sql.connect(
            service.uri,
            db_kwargs={
                "username": "alice", "password": PASSWORDS["alice"],
                "adbc.flight.sql.client_option.tls_root_certs": roots.decode(),
            },
            autocommit=True,
        ) as conn, conn.cursor() as cur:  # fmt: skip
            cur.execute(SCAN)
            assert sorted_rows(cur.fetch_arrow_table()) == oracle(SCAN)
        with shardflow.connect(
            service.uri, user="alice", password=PASSWORDS["alice"], tls_root_certs=roots
        ) as remote:
            assert sorted_rows(remote.sql(SCAN)) == oracle(SCAN)
    finally:
        assert service.stop() == 0, "".join(service.output[-50:])
