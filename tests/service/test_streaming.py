"""A query's answer through the Flight SQL service is read as the workers send it, never
held whole: the service's memory grows by its buffer (``stream_buffer_mb``), not by the
answer's size, and a client that stops reading early ends the reading. A real ``shardflow
serve`` process, its memory read from /proc as a client fetches."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import shardflow
from shardflow.flightsql import wire as fsql
from tests.service.conftest import PASSWORDS, Served, add_users, start_service

ROWS = 1_000_000
PAD = 240
BUFFER_MB = 8


@pytest.fixture(scope="module")
def wide_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A service over a table whose answer is ~250 MB, made before the service started (its
    process never held the rows), in units of 32 MB on both workers, serving with an 8 MB
    buffer. (Held whole, the answer grew the service by more than its size; streamed, by
    ~65 MB: the buffer, the parts in flight and what Arrow's allocator keeps.)"""
    data_dir = tmp_path_factory.mktemp("wide")
    add_users(data_dir)
    ids = pa.array(range(ROWS), pa.int64())
    pads = pa.compute.binary_join_element_wise(
        pa.compute.cast(ids, pa.string()), pa.scalar("x" * PAD), ""
    )
    with shardflow.connect(workers=2, data_dir=data_dir, initial_shard_bytes=32 << 20) as db:
        db.create_table("wide", pa.table({"id": ids, "pad": pads}), distributed_by="id")
        db.grant("wide", "SELECT", "reader")
    service = start_service(data_dir, "--set", f"stream_buffer_mb={BUFFER_MB}")
    yield service
    assert service.stop() == 0, "".join(service.output[-50:])


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakMemory:
    """The most resident memory a process had while sampled (every 5 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def ask(served: Served, query: str) -> tuple[flight.FlightClient, flight.FlightInfo, object]:
    client = flight.FlightClient(served.uri)
    options = flight.FlightCallOptions(
        headers=[client.authenticate_basic_token("alice", PASSWORDS["alice"])]
    )
    command = fsql.pack(fsql.new("CommandStatementQuery", query=query))
    info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
    return client, info, options


def test_a_big_answer_passes_through_the_service_without_being_held(
    wide_service: Served,
) -> None:
    pid = wide_service.process.pid
    before = rss(pid)
    peak = PeakMemory(pid)
    client, info, options = ask(wide_service, "SELECT id, pad FROM wide")
    assert info.total_records == -1  # read as it arrives: not counted before it is sent
    rows = size = ids = 0
    for chunk in client.do_get(info.endpoints[0].ticket, options):
        rows += chunk.data.num_rows
        size += chunk.data.nbytes
        ids += pa.compute.sum(chunk.data.column("id")).as_py() or 0
        time.sleep(0.001)  # a reader slower than the workers
    grown = peak.stop() - before
    client.close()
    assert rows == ROWS and ids == ROWS * (ROWS - 1) // 2
    assert size > 200 << 20
    assert grown < size // 2, f"the service grew by {grown >> 20} MB for a {size >> 20} MB answer"


def test_a_client_that_stops_reading_ends_the_reading(wide_service: Served) -> None:
    client, info, options = ask(wide_service, "SELECT id, pad FROM wide")
    reader = client.do_get(info.endpoints[0].ticket, options)
    assert reader.read_chunk().data.num_rows > 0
    reader.cancel()
    client.close()
    client, info, options = ask(wide_service, "SELECT count(*) AS n FROM wide")
    assert client.do_get(info.endpoints[0].ticket, options).read_all().to_pylist() == [{"n": ROWS}]
    client.close()


def test_the_remote_database_streams_as_the_local_one(wide_service: Served) -> None:
    with shardflow.connect(wide_service.uri, user="alice", password=PASSWORDS["alice"]) as db:
        reader = db.stream("SELECT id FROM wide WHERE id % ? = 0", [1000])
        got = reader.read_all()
        assert isinstance(reader, pa.RecordBatchReader)
        assert sorted(got.column("id").to_pylist()) == list(range(0, ROWS, 1000))
        assert db.sql("SELECT count(*) AS n FROM wide").to_pylist() == [{"n": ROWS}]
