"""``shardflow.connect("grpc://...")`` against a Flight server of the test's own (real gRPC on
loopback, no cluster): an answer cut off as the cluster changed (the service says
``AnswerInterrupted``, before its first batch or after some) is fetched once more by
``sql``; a second cut is said; ``stream`` says it at once, after the batches it gave. An
answer in parts at the workers' own endpoints is read from them with the caller's token,
and a worker gone before its part was read runs the query once more."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from shardflow.errors import AnswerInterrupted
from shardflow.flightsql.client import RemoteDatabase
from shardflow.service.server import flight_error

ROWS = pa.table({"id": pa.array(range(10), pa.int64())})


class CutOff(flight.FlightServerBase):  # type: ignore[misc]
    """Answers every query with ROWS, cutting off the first ``cuts`` of its DoGets after
    ``sent`` batches, as the service does when a worker dies while its part is read."""

    def __init__(self, cuts: int, sent: int) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.cuts, self.sent, self.gets = cuts, sent, 0

    def get_flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.FlightInfo:
        endpoint = flight.FlightEndpoint(b"answer", [])
        return flight.FlightInfo(ROWS.schema, descriptor, [endpoint], -1, -1)

    def do_get(
        self, context: flight.ServerCallContext, ticket: flight.Ticket
    ) -> flight.GeneratorStream:
        self.gets += 1
        cut = self.gets <= self.cuts

        def batches() -> Iterator[pa.RecordBatch]:
            for index, batch in enumerate(ROWS.to_batches(max_chunksize=2)):
                if cut and index == self.sent:
                    raise flight_error(AnswerInterrupted("node-1 went away; run the query again"))
                yield batch

        return flight.GeneratorStream(ROWS.schema, batches())


@pytest.mark.parametrize("sent", [0, 2])
def test_sql_fetches_an_answer_cut_off_once_more(sent: int) -> None:
    server = CutOff(cuts=1, sent=sent)
    db = RemoteDatabase(f"grpc://127.0.0.1:{server.port}", token="t")
    try:
        assert db.sql("SELECT id FROM t").equals(ROWS)
        assert server.gets == 2
    finally:
        db.close()
        server.shutdown()


def test_an_answer_cut_off_twice_is_said() -> None:
    server = CutOff(cuts=3, sent=1)
    db = RemoteDatabase(f"grpc://127.0.0.1:{server.port}", token="t")
    try:
        with pytest.raises(AnswerInterrupted, match="run the query again"):
            db.sql("SELECT id FROM t")
        assert server.gets == 2
        reader = db.stream("SELECT id FROM t")  # a reader gets what was sent, then the cut
        assert reader.read_next_batch().num_rows == 2
        with pytest.raises(AnswerInterrupted):
            reader.read_next_batch()
    finally:
        db.close()
        server.shutdown()


class Worker(flight.FlightServerBase):  # type: ignore[misc]
    """A worker's endpoint of the test's own: its ticket names the rows it sends; it keeps
    the ``authorization`` header each read came with."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0", middleware={"seen": Seen()})
        self.location = f"grpc://127.0.0.1:{self.port}"

    def do_get(
        self, context: flight.ServerCallContext, ticket: flight.Ticket
    ) -> flight.RecordBatchStream:
        start = int(ticket.ticket)
        return flight.RecordBatchStream(ROWS.slice(start, 5))


class Seen(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    headers: ClassVar[list[str]] = []

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> None:
        Seen.headers.extend(headers.get("authorization", []))


class Parted(flight.FlightServerBase):  # type: ignore[misc]
    """A service that answers with a part at each of two workers; its first answer names a
    worker that is gone (as when one died between GetFlightInfo and DoGet)."""

    def __init__(self, live: list[Worker], gone: str) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.live, self.gone, self.infos = live, gone, 0

    def get_flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.FlightInfo:
        self.infos += 1
        first = self.gone if self.infos == 1 else self.live[0].location
        endpoints = [
            flight.FlightEndpoint(b"0", [first]),
            flight.FlightEndpoint(b"5", [self.live[1].location]),
        ]
        return flight.FlightInfo(ROWS.schema, descriptor, endpoints, -1, -1)


def test_parts_are_read_from_the_workers_and_a_worker_gone_runs_the_query_once_more() -> None:
    live = [Worker(), Worker()]
    dead = Worker()
    gone = dead.location
    dead.shutdown()
    service = Parted(live, gone)
    db = RemoteDatabase(f"grpc://127.0.0.1:{service.port}", token="t")
    try:
        assert db.sql("SELECT id FROM t").equals(ROWS)  # both parts, in the endpoints' order
        assert service.infos == 2  # the first answer's worker was gone: asked once more
        assert set(Seen.headers) == {"Bearer t"}  # the caller's token went to each worker
        assert db.stream("SELECT id FROM t").read_all().equals(ROWS)
    finally:
        db.close()
        service.shutdown()
        for worker in live:
            worker.shutdown()
