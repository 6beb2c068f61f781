"""close() while calls are in flight: each of them, and every call after, ends with a
``ClosedError`` within a second or two — never a Ray exception, never a hang, and Ray is
not started again behind the user's back."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

import shardflow

pytestmark = pytest.mark.cluster

BUSY_THREADS = 4
SETTLE_S = 3.0  # every in-flight call has ended this long after close() returned


def test_calls_in_flight_at_close_and_after_raise_closed_error(tmp_path: Path) -> None:
    import ray

    ray_before = ray.is_initialized()  # a cluster of another test in this process keeps it up
    # a unit per worker and a small buffer: a stream read in part is still being sent
    db = shardflow.connect(
        workers=2, data_dir=tmp_path / "data", initial_shard_bytes=0, stream_buffer_mb=1
    )
    rows = pa.table({"k": pa.array(range(1_000), pa.int64()), "v": [1.0] * 1_000})
    db.create_table("t", rows, distributed_by="k")
    many = 3_000_000  # far more than the buffer and the lanes hold
    db.create_table("big", pa.table({"k": pa.array(range(many)), "s": ["x" * 40] * many}),
                    distributed_by="k")  # fmt: skip
    reading = db.stream("SELECT * FROM big")
    assert reading.read_next_batch().num_rows > 0
    outcomes: list[BaseException | None] = [None] * BUSY_THREADS
    started = threading.Barrier(BUSY_THREADS + 1)

    def busy(i: int) -> None:
        started.wait()
        try:
            while True:  # inserts and queries until close() stops them
                if i % 2:
                    db.insert("t", rows.slice(0, 10))
                else:
                    db.sql("SELECT k % 7 AS g, sum(v) FROM t GROUP BY g")
        except BaseException as error:
            outcomes[i] = error

    threads = [threading.Thread(target=busy, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(1.0)
    session = db._session  # a call that passed the open check just before close() ran
    db.close()
    closed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=max(0.1, closed_at + SETTLE_S - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a call in flight at close() still hangs"
    for error in outcomes:
        assert isinstance(error, shardflow.ClosedError), repr(error)
        assert "closed" in str(error)
    with pytest.raises(shardflow.ClosedError, match="connect"):  # not "run it again"
        reading.read_all()
    for call in (
        lambda: db.sql("SELECT 1"),
        lambda: db.insert("t", rows),
        lambda: db.tables(),
        lambda: db.cluster.nodes(),
    ):
        with pytest.raises(shardflow.ClosedError, match="connect"):
            call()
    # Ray stops with the last database of this process that uses it; no call after close()
    # starts it again
    assert ray.is_initialized() == ray_before, "a call after close() started Ray again"
    assert session is not None
    with pytest.raises(Exception):  # noqa: B017 -- any error, but no hang and no new Ray
        session.insert("t", rows)
    assert ray.is_initialized() == ray_before, "a call in flight at close() started Ray again"
    db.close()  # a second close is harmless


def test_a_load_in_flight_at_close_ends_with_closed_error_and_leaves_no_table(
    tmp_path: Path,
) -> None:
    """close() while a load sends its batches: the load ends with a ClosedError between two
    batches, before Ray stops (a thread that touches Ray after that ends the process), and
    the table is not there when the data directory is opened again."""
    schema = pa.schema([("k", pa.int64()), ("s", pa.string())])
    streaming = threading.Event()

    db = shardflow.connect(workers=2, data_dir=tmp_path / "data", load_batch_rows=1000)

    def endless() -> Iterator[pa.RecordBatch]:  # a producer that never ends by itself
        for n in itertools.count():
            if n == 3:  # two batches are in the workers: the load is in flight
                streaming.set()
                db._closing.wait()  # the next batch comes while close() stops the cluster
                time.sleep(0.2)  # inside Ray's shutdown, were close() not to wait for the load
            yield pa.record_batch(
                [pa.array(range(n * 1000, n * 1000 + 1000)), ["x"] * 1000], schema=schema
            )

    outcome: list[BaseException | None] = []
    source = pa.RecordBatchReader.from_batches(schema, endless())
    loading = threading.Thread(
        target=lambda: outcome.append(
            _raised(lambda: db.create_table("t", source, distributed_by="k"))
        )
    )
    loading.start()
    assert streaming.wait(60), "the load never started"
    db.close()
    loading.join(SETTLE_S)
    assert not loading.is_alive(), "the load in flight at close() still runs"
    [error] = outcome
    assert isinstance(error, shardflow.ClosedError), repr(error)
    with shardflow.connect(workers=2, data_dir=tmp_path / "data") as again:
        assert again.tables().num_rows == 0


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as error:
        return error
    return None
