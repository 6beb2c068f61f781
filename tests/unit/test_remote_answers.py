"""``shardflow.connect("grpc://...")`` against a Flight server of the test's own (real gRPC on
loopback, no cluster): an answer cut off as the cluster changed (the service says
``AnswerInterrupted``, before its first batch or after some) is fetched once more by
``sql``; a second cut is said; ``stream`` says it at once, after the batches it gave."""

from __future__ import annotations

from collections.abc import Iterator

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
