"""The fast lane's transport on its own (no Ray): a real listening socket on loopback, a
worker side that runs fragments with DuckDB, the session's client side."""

from __future__ import annotations

import gc
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import cast

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from shardflow.control.migration import Checksum, SourceChecksums
from shardflow.engine import DuckDBEngine
from shardflow.errors import ClusterError, Moved, QueryError, TableError
from shardflow.runtime import fastlane
from shardflow.runtime.fastlane import (
    ARROW_FRAME_BYTES,
    STREAM_FRAME_BYTES,
    LaneBook,
    LaneBroken,
    Lanes,
    LaneServer,
    to_wire,
)
from shardflow.runtime.protocol import (
    Answered,
    ChangeSet,
    FenceResult,
    FinalApplied,
    FragmentStats,
    LaneAddress,
    Workers,
)
from shardflow.storage.shard import Change

ROWS = pa.table({"k": pa.array(range(1000), pa.int64()), "s": [f"row {i}" for i in range(1000)]})


class Worker:
    """Runs fragments over ``t`` with DuckDB, as a worker runs them over its shards."""

    def __init__(self) -> None:
        self.engine = DuckDBEngine(threads=1)
        self.calls: list[tuple[str, Mapping[str, list[int]], int, bool]] = []
        self.commits: list[Mapping[str, int]] = []

    def run(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int],
        emit: Callable[[pa.Table], None] | None = None,
    ) -> tuple[pa.Table, FragmentStats]:
        self.calls.append((sql, bindings, epoch, profile))
        self.commits.append(commits)
        if epoch < 0:
            raise Moved("t#1", 3)
        if sql == "crash":
            raise RuntimeError("a bug of the worker's own")
        if sql == "late" and emit is not None:  # a part, then the query's own error
            emit(ROWS.slice(0, 10))
            raise QueryError("a value that does not convert, late in the result")
        try:
            if emit is not None:  # in parts as DuckDB makes them, as a worker's node does
                schema = self.engine.run_in_parts(sql, emit, {"t": ROWS, **inputs})
                return schema.empty_table(), FragmentStats(0.001, 0, engine="duckdb")
            result = self.engine.run(sql, {"t": ROWS, **inputs})
        except duckdb.Error as error:
            raise QueryError(str(error)) from None
        return result, FragmentStats(0.001, result.num_rows, engine="duckdb")


@pytest.fixture
def lane() -> Iterator[tuple[LaneServer, Worker, Lanes]]:
    worker = Worker()
    server = LaneServer(worker.run, "127.0.0.1", "node-0")
    lanes = Lanes()
    yield server, worker, lanes
    lanes.close()
    server.close()
    worker.engine.close()


def test_a_fragment_and_its_measurements_come_back(
    lane: tuple[LaneServer, Worker, Lanes],
) -> None:
    server, worker, lanes = lane
    assert server.address.host == "127.0.0.1"
    result, stats = lanes.execute(
        server.address, "SELECT * FROM t WHERE k = 7", {"t": [1]}, 5, True, commits={"t": 2}
    )
    assert result.to_pylist() == [{"k": 7, "s": "row 7"}]
    assert stats == FragmentStats(0.001, 1, engine="duckdb")
    assert worker.calls == [("SELECT * FROM t WHERE k = 7", {"t": [1]}, 5, True)]
    assert worker.commits == [{"t": 2}]  # the tables' commits travel with the fragment
    whole, _ = lanes.execute(server.address, "SELECT * FROM t, range(300)", {}, 5, False)
    assert whole.num_rows == 300_000  # megabytes: written in parts, read whole
    assert whole.slice(0, 1000).column("k").to_pylist() == list(range(1000))


def test_a_fragments_inputs_go_along_with_it(lane: tuple[LaneServer, Worker, Lanes]) -> None:
    """A later stage reads what the client merged of an earlier one: the rows travel with
    the request, small or in parts of megabytes, and a refused fragment still reads them
    all (the next call on the same connection is answered)."""
    server, _, lanes = lane
    keys = pa.table({"k": pa.array([3, 5, 7], pa.int64())})
    many = pa.table({"n": pa.array(range(400_000), pa.int64())})  # more than a frame
    assert many.nbytes > ARROW_FRAME_BYTES
    sql = "SELECT t.k, t.s, (SELECT count(*) FROM many) AS n FROM t JOIN keys USING (k) ORDER BY k"
    result, _ = lanes.execute(server.address, sql, {}, 1, False, {"keys": keys, "many": many})
    assert result.to_pylist() == [{"k": k, "s": f"row {k}", "n": 400_000} for k in (3, 5, 7)]
    with pytest.raises(QueryError):
        lanes.execute(server.address, "SELECT nothing FROM keys", {}, 1, False, {"keys": keys})
    [kept] = lanes._idle[server.address]
    again, _ = lanes.execute(server.address, "SELECT count(*) AS n FROM t", {}, 1, False)
    assert again.to_pylist() == [{"n": 1000}]
    assert lanes._idle[server.address] == [kept]  # the same connection, still in step


def test_the_workers_errors_arrive_as_they_were_raised(
    lane: tuple[LaneServer, Worker, Lanes],
) -> None:
    server, _, lanes = lane
    with pytest.raises(QueryError, match="nope"):
        lanes.execute(server.address, "SELECT nope FROM t", {}, 0, False)
    with pytest.raises(Moved):  # retryable: the session refreshes its routing and retries
        lanes.execute(server.address, "SELECT 1", {}, -1, False)
    with pytest.raises(ClusterError, match="a bug of the worker's own") as caught:
        lanes.execute(server.address, "crash", {}, 0, False)
    assert not isinstance(caught.value, LaneBroken)
    result, _ = lanes.execute(server.address, "SELECT count(*) AS n FROM t", {}, 0, False)
    assert result.to_pylist() == [{"n": 1000}]  # the same connection serves on


def test_a_peer_without_the_token_gets_nothing(lane: tuple[LaneServer, Worker, Lanes]) -> None:
    server, worker, lanes = lane
    forged = LaneAddress(server.address.host, server.address.port, "00" * 16)
    with pytest.raises(LaneBroken):
        lanes.execute(forged, "SELECT 1", {}, 0, False)
    with socket.create_connection((server.address.host, server.address.port)) as peer:
        peer.sendall(b"\x00" * 16 + b"\x00" * 7 + b"\x10" + b'{"sql": "SELECT 1"}')
        peer.settimeout(5)
        try:
            answer = peer.recv(100)
        except ConnectionResetError:  # hung up with our bytes unread
            answer = b""
        assert answer == b""  # hung up, unanswered
    assert worker.calls == []


def test_a_lane_whose_worker_is_gone_is_broken(lane: tuple[LaneServer, Worker, Lanes]) -> None:
    server, _, lanes = lane
    lanes.execute(server.address, "SELECT 1", {}, 0, False)  # a connection kept open
    server.close()
    with pytest.raises(LaneBroken):  # the kept connection is refused an answer, or fails
        for _ in range(3):
            lanes.execute(server.address, "SELECT 1", {}, 0, False)


def test_clients_in_many_threads_each_get_their_own_answer(
    lane: tuple[LaneServer, Worker, Lanes],
) -> None:
    server, _, lanes = lane
    wrong: list[object] = []

    def client(first: int) -> None:
        for key in range(first, 1000, 8):
            result, _ = lanes.execute(
                server.address, f"SELECT s FROM t WHERE k = {key}", {}, 0, False
            )
            if result.to_pylist() != [{"s": f"row {key}"}]:
                wrong.append((key, result.to_pylist()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_closing_the_client_closes_connections_still_in_use() -> None:
    """A session closed while a query is on a lane: that connection closes when the call
    ends rather than being kept (an unclosed socket fails the test when collected)."""
    release = threading.Event()
    worker = Worker()

    def slow(
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int],
        emit: Callable[[pa.Table], None] | None = None,
    ) -> tuple[pa.Table, FragmentStats]:
        release.wait(10)
        return worker.run(sql, bindings, epoch, profile, inputs, commits)

    server = LaneServer(slow, "127.0.0.1", "node-0")
    lanes = Lanes()
    answers: list[object] = []
    call = threading.Thread(
        target=lambda: answers.append(lanes.execute(server.address, "SELECT 1 AS x", {}, 0, False))
    )
    call.start()
    time.sleep(0.2)
    lanes.close()
    release.set()
    call.join(10)
    assert len(answers) == 1 and lanes._idle == {}
    server.close()
    worker.engine.close()
    gc.collect()


def test_a_closed_server_hangs_up_on_its_clients(lane: tuple[LaneServer, Worker, Lanes]) -> None:
    server, _, lanes = lane
    lanes.execute(server.address, "SELECT 1", {}, 0, False)
    [kept] = lanes._idle[server.address]
    server.close()
    kept.settimeout(5)
    assert kept.recv(1) == b""  # hung up


def test_a_worker_runs_at_most_its_concurrency_of_fragments_at_once() -> None:
    worker = Worker()
    running = 0
    most = 0
    lock = threading.Lock()

    def slow(
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int],
    ) -> tuple[pa.Table, FragmentStats]:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return worker.run(sql, bindings, epoch, profile, inputs, commits)

    server = LaneServer(slow, "127.0.0.1", "node-0", concurrency=2)
    lanes = Lanes()
    calls = [
        threading.Thread(target=lanes.execute, args=(server.address, "SELECT 1", {}, 0, False))
        for _ in range(6)
    ]
    for call in calls:
        call.start()
    for call in calls:
        call.join(10)
    assert len(worker.calls) == 6 and most == 2  # all ran, never more than two at once
    lanes.close()
    server.close()
    worker.engine.close()


class Loader:
    """Takes a load's parts as a worker's ``stage`` does (and refuses an unknown table)."""

    def __init__(self) -> None:
        self.staged: list[tuple[str, dict[int | str, pa.Table]]] = []

    def stage(self, table: str, parts: Mapping[int | str, pa.Table]) -> int:
        if table != "t":
            raise TableError(f"no load of {table!r} is under way")
        self.staged.append((table, dict(parts)))
        return sum(part.num_rows for part in parts.values())


def test_a_loads_parts_go_over_the_lane_as_they_were() -> None:
    loader = Loader()
    worker = Worker()
    server = LaneServer(worker.run, "127.0.0.1", "node-0", stage=loader.stage)
    lanes = Lanes()
    big = pa.table({"k": pa.array(range(300_000), pa.int64())})  # over ARROW_FRAME_BYTES
    assert big.nbytes >= ARROW_FRAME_BYTES > ROWS.nbytes
    try:
        rows = lanes.stage(server.address, "t", {3: to_wire(big), "replica": to_wire(ROWS)})
        assert rows == big.num_rows + ROWS.num_rows
        [(table, parts)] = loader.staged
        assert table == "t" and list(parts) == [3, "replica"]  # the units' keys as they were
        assert parts[3].equals(big) and parts["replica"].equals(ROWS)
        with pytest.raises(TableError, match="no load of 'u'"):
            lanes.stage(server.address, "u", {0: to_wire(ROWS)})
        assert lanes.stage(server.address, "t", {}) == 0  # the same connection serves on
    finally:
        lanes.close()
        server.close()
        worker.engine.close()


def test_a_lane_without_a_loader_refuses_loads(lane: tuple[LaneServer, Worker, Lanes]) -> None:
    server, _, lanes = lane
    with pytest.raises(ClusterError, match="takes no loads") as caught:
        lanes.stage(server.address, "t", {0: to_wire(ROWS)})
    assert not isinstance(caught.value, LaneBroken)
    result, _ = lanes.execute(server.address, "SELECT count(*) AS n FROM t", {}, 0, False)
    assert result.to_pylist() == [{"n": 1000}]  # the parts were read: the lane serves on


class Source:
    """A move's source side as a worker's ``SourceSide`` answers: the chunks it hands out,
    its fence (the last changes and the checksums) and its retire (how long writers were
    held, once)."""

    def __init__(self) -> None:
        self.chunks = {("t", 3): [ROWS, pa.table({"k": pa.array(range(300_000), pa.int64())})]}
        self.fenced: list[str] = []
        self.retired: set[str] = set()

    def _known(self, move_id: str) -> None:
        if move_id != "m1":
            raise Moved(f"no move {move_id}", 2)

    def chunk(self, move_id: str, key: tuple[str, int]) -> pa.Table | None:
        self._known(move_id)
        left = self.chunks[key]
        return left.pop(0) if left else None

    def fence(self, move_id: str) -> FenceResult:
        self._known(move_id)
        self.fenced.append(move_id)
        change = Change(7, "batch-1", ROWS.slice(0, 5), np.arange(5, dtype=np.int32))
        sums = SourceChecksums("node-0", {"t": Checksum(1005, 12345)}, {"t": 1005})
        return FenceResult(ChangeSet("node-0", {("t", 3): (change,)}), sums)

    def retire(self, move_id: str) -> float | None:
        self._known(move_id)
        if move_id in self.retired:
            return None
        self.retired.add(move_id)
        return 0.012


def test_a_moves_chunks_come_over_the_lane_until_the_last() -> None:
    """The target of a move pulls its source's snapshot chunk by chunk: each as the source
    handed it out, then None; the source's errors as raised."""
    worker = Worker()
    server = LaneServer(worker.run, "127.0.0.1", "node-0", source=Source())
    lanes = Lanes()
    try:
        first = lanes.chunk(server.address, "m1", ("t", 3))
        second = lanes.chunk(server.address, "m1", ("t", 3))
        assert first is not None and first.equals(ROWS)
        assert second is not None and second.num_rows == 300_000
        assert lanes.chunk(server.address, "m1", ("t", 3)) is None
        with pytest.raises(Moved, match="no move m2"):
            lanes.chunk(server.address, "m2", ("t", 3))
    finally:
        lanes.close()
        server.close()
    without, lanes = LaneServer(worker.run, "127.0.0.1", "node-1"), Lanes()
    assert without.address.steps == ()  # asked through Ray instead
    old = dict(without.address.__dict__)  # an address of 0.2.0, as Ray unpickles it here
    del old["steps"]
    from_old = object.__new__(LaneAddress)
    from_old.__dict__.update(old)
    assert from_old.steps == () and from_old.port == without.address.port
    try:
        for step in (
            lambda: lanes.chunk(without.address, "m1", ("t", 3)),
            lambda: lanes.fence(without.address, "m1"),
            lambda: lanes.retire(without.address, "m1"),
            lambda: lanes.finish(without.address, "m1"),
        ):
            with pytest.raises(ClusterError, match="takes no step of a move") as caught:
                step()
            assert not isinstance(caught.value, LaneBroken)
    finally:
        lanes.close()
        without.close()
        worker.engine.close()


def test_a_moves_fence_finish_and_retire_come_over_the_lanes() -> None:
    """Writers wait from a source's fence to its retire, so each step between goes over a
    lane: the fence's answer (the last changes, rows and buckets, and the checksums)
    arrives whole, the target's finish answers what it applied and stores, the retire says
    how long writers were held and, asked again, that it retired already; errors are
    raised as the worker raised them."""
    source, worker = Source(), Worker()

    def finish(move_id: str) -> FinalApplied:
        if move_id != "m1":
            raise Moved(f"no move {move_id}", 2)
        return FinalApplied(5, {"t": Checksum(1005, 12345)}, promoted=True)

    server = LaneServer(worker.run, "127.0.0.1", "node-0", source=source, finish=finish)
    assert server.address.steps == ("fence", "retire", "finish")  # what it says it takes
    lanes = Lanes()
    try:
        finished = lanes.finish(server.address, "m1")
        assert finished == FinalApplied(5, {"t": Checksum(1005, 12345)}, promoted=True)
        with pytest.raises(Moved, match="no move m3"):
            lanes.finish(server.address, "m3")
        fenced = lanes.fence(server.address, "m1")
        assert source.fenced == ["m1"]
        [change] = fenced.changes.changes[("t", 3)]
        assert (change.lsn, change.batch_id) == (7, "batch-1")
        assert change.rows.equals(ROWS.slice(0, 5))
        assert change.buckets is not None and change.buckets.tolist() == [0, 1, 2, 3, 4]
        assert fenced.sums.handed_out == {"t": Checksum(1005, 12345)}
        assert fenced.changes.rows == 5
        assert lanes.retire(server.address, "m1") == 0.012
        assert lanes.retire(server.address, "m1") is None  # retired already
        with pytest.raises(Moved, match="no move m2"):
            lanes.fence(server.address, "m2")
        result, _ = lanes.execute(server.address, "SELECT count(*) AS n FROM t", {}, 0, False)
        assert result.to_pylist() == [{"n": 1000}]  # the same connection serves on
    finally:
        lanes.close()
        server.close()
        worker.engine.close()


# -- a fragment's result read in parts as it arrives (``Lanes.stream``) --------------------
def test_a_streamed_result_comes_in_parts_and_the_connection_serves_on(
    lane: tuple[LaneServer, Worker, Lanes],
) -> None:
    server, worker, lanes = lane
    parts = list(lanes.stream(server.address, "SELECT * FROM t, range(300)", {"t": [1]}, 5, {}))
    assert len(parts) > 1 and all(p.nbytes <= STREAM_FRAME_BYTES for p in parts)
    whole = pa.concat_tables(parts)
    assert whole.num_rows == 300_000
    assert whole.slice(0, 1000).column("k").to_pylist() == list(range(1000))
    assert worker.calls[-1] == ("SELECT * FROM t, range(300)", {"t": [1]}, 5, False)
    [empty] = lanes.stream(server.address, "SELECT k FROM t WHERE k < 0", {}, 5, {})
    assert empty.num_rows == 0 and empty.schema.names == ["k"]  # the schema comes still
    with pytest.raises(Moved):  # the worker's error, before any part
        lanes.stream(server.address, "SELECT 1", {}, -1, {})
    late = lanes.stream(server.address, "late", {}, 0, {})
    assert next(late).num_rows == 10
    with pytest.raises(QueryError, match="late in the result"):  # after a part
        next(late)
    [kept] = lanes._idle[server.address]  # one connection, in step after all of that
    again, _ = lanes.execute(server.address, "SELECT count(*) AS n FROM t", {}, 1, False)
    assert again.to_pylist() == [{"n": 1000}] and lanes._idle[server.address] == [kept]


def test_a_streamed_result_left_early_hangs_up(lane: tuple[LaneServer, Worker, Lanes]) -> None:
    """A reader that stops: the connection closes (it is out of step), the worker stops
    sending and serves the next client."""
    server, _, lanes = lane
    parts = lanes.stream(server.address, "SELECT * FROM t, range(3000)", {}, 0, {})
    first = next(parts)
    assert first.num_rows > 0
    parts.close()  # type: ignore[attr-defined]
    assert lanes._idle.get(server.address, []) == []
    result, _ = lanes.execute(server.address, "SELECT count(*) AS n FROM t", {}, 0, False)
    assert result.to_pylist() == [{"n": 1000}]


def test_a_stream_that_breaks_off_says_so() -> None:
    """A worker that dies between parts: the reader gets ``LaneBroken`` after the parts
    it read, not an answer that looks whole."""
    listener = socket.create_server(("127.0.0.1", 0))
    token = "11" * 16

    def dying_worker() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(1 << 16)  # the token and the request
            frames = [b"\x00", to_wire(ROWS.slice(0, 2))]  # a part
            connection.sendall(b"".join(struct.pack("!Q", len(f)) + bytes(f) for f in frames))
            connection.sendall(struct.pack("!Q", 1 << 20) + b"\x00" * 100)  # then gone

    thread = threading.Thread(target=dying_worker)
    thread.start()
    lanes = Lanes()
    address = LaneAddress("127.0.0.1", listener.getsockname()[1], token)
    parts = lanes.stream(address, "SELECT * FROM t", {}, 0, {})
    assert next(parts).num_rows == 2
    with pytest.raises(LaneBroken, match="broke off"):
        next(parts)
    thread.join(10)
    listener.close()
    lanes.close()


def test_a_move_step_to_a_worker_that_never_answers_fails_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker cut off by a partition takes a step's request and never answers: the
    fence, the finish and the retire fail with ``LaneBroken`` after ``STEP_TIMEOUT_S``
    (the move rolls back) instead of waiting for TCP to give up while writers are held. A
    fragment on the same lane has no such limit (a query may run long)."""
    monkeypatch.setattr(fastlane.client, "STEP_TIMEOUT_S", 0.3)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def silent_worker() -> None:
        while len(accepted) < 3:
            connection, _ = listener.accept()
            accepted.append(connection)  # reads nothing, answers nothing

    thread = threading.Thread(target=silent_worker, daemon=True)
    thread.start()
    lanes = Lanes()
    address = LaneAddress("127.0.0.1", listener.getsockname()[1], "22" * 16)
    try:
        for step in (lanes.fence, lanes.finish, lanes.retire):
            failed: list[Exception] = []

            def ask(
                step: Callable[[LaneAddress, str], object] = step,
                failed: list[Exception] = failed,
            ) -> None:
                try:
                    step(address, "m1")
                except Exception as raised:
                    failed.append(raised)

            asking = threading.Thread(target=ask, daemon=True)
            asking.start()
            asking.join(10)
            assert not asking.is_alive(), f"{step.__name__} still waits for its answer"
            [error] = failed
            assert isinstance(error, LaneBroken) and "timed out" in str(error), error
    finally:
        lanes.close()
        listener.close()
        for connection in accepted:
            connection.close()


class Known:
    """A worker as the lane book looks it up: its instance, and its lane's address (asked
    through the protocol, each question counted)."""

    def __init__(self, address: LaneAddress | None) -> None:
        self.instance = object()
        self.address = address
        self.asked = 0

    def fast_lane(self) -> Answered[LaneAddress | None]:
        self.asked += 1
        return Answered(self.address)


class Book:
    def __init__(self, workers: dict[str, Known]) -> None:
        self.workers = workers

    def get(self, node: str) -> Known:
        return self.workers[node]


def test_a_lane_book_asks_once_a_worker_and_knows_without_asking() -> None:
    """A step taken while writers wait (a retire) uses a lane only where its address is
    known already (asking would cost a round trip in the pause); a worker's address is
    asked once, and again only of a new worker of the node; a lane that failed is not
    used again for that worker."""
    lane = LaneAddress("127.0.0.1", 1, "33" * 16, steps=("fence", "retire", "finish"))
    workers = {"node-0": Known(lane)}
    book = LaneBook(cast("Workers", Book(workers)), enabled=True)
    try:
        assert book.known("node-0") is None and workers["node-0"].asked == 0
        assert book.address("node-0") == lane and book.address("node-0") == lane
        assert book.known("node-0") == lane and workers["node-0"].asked == 1
        workers["node-0"] = Known(lane)  # a new worker of the node: asked anew
        assert book.known("node-0") is None
        assert book.address("node-0") == lane and workers["node-0"].asked == 1
        book.broken("node-0", LaneBroken("cut off"))
        assert book.known("node-0") is None and book.address("node-0") is None
        off = LaneBook(cast("Workers", Book(workers)), enabled=False)
        assert off.address("node-0") is None and off.known("node-0") is None
        off.close()
    finally:
        book.close()
