"""An answer far bigger than the service may hold: ``SELECT * FROM big`` (``--gb`` of Arrow
data, made up: an id, a number and an 80-character text per row) through ``shardflow
serve`` in a process of its own, with every byte through the service
(``flight_endpoints=service``), read by ``pyarrow.flight`` and dropped batch by batch.
Measured: the service process's resident memory high-water mark before and after, the
time to the first batch and to the end, and the rows counted against the table's.

The last line is ``answer_gb=A service_peak_mb=P ttfb_ms=T answer_mb_s=R``.

    python bench/big_answer.py --gb 5 --workers 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

import shardflow
from shardflow.flightsql import wire as fsql
from shardflow.service.auth import AuthStore

sys.path.insert(0, str(Path(__file__).parent))
from serve import PASSWORD, USER, peak_mb, served

ROWS_PER_BATCH = 500_000
TEXT = 80


def batches(gb: float) -> Iterator[pa.RecordBatch]:
    """Rows of about ``gb`` GB as Arrow (each row ~100 bytes), batch by batch."""
    per_row = 8 + 8 + TEXT + 4
    total = int(gb * 1e9 / per_row)
    rng = np.random.default_rng(7)
    pad = "x" * (TEXT - 16)
    for start in range(0, total, ROWS_PER_BATCH):
        count = min(ROWS_PER_BATCH, total - start)
        ids = np.arange(start, start + count, dtype=np.int64)
        texts = pa.array([f"{i:016d}{pad}" for i in range(start, start + count)])
        yield pa.record_batch(
            [pa.array(ids), pa.array(rng.random(count)), texts], names=["id", "v", "s"]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--buffer-mb", type=int, default=64, help="the service's stream_buffer_mb")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    args = parser.parse_args()
    args.home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-big-", dir=args.home) as data_dir:
        AuthStore(data_dir).add_user(USER, "reader", PASSWORD)
        schema = next(batches(0.001)).schema
        started = time.perf_counter()
        with shardflow.connect(workers=args.workers, data_dir=data_dir) as db:
            db.create_table("big", pa.RecordBatchReader.from_batches(schema, batches(args.gb)),
                            distributed_by="id")  # fmt: skip
            rows = db.sql("SELECT count(*) FROM big").column(0)[0].as_py()
        print(f"loaded {rows:,} rows (~{args.gb:g} GB as Arrow) in "
              f"{time.perf_counter() - started:.0f} s")  # fmt: skip
        with served(data_dir, args.workers, "service", args.buffer_mb) as (uri, pid):
            client = flight.FlightClient(uri)
            token = client.authenticate_basic_token(USER, PASSWORD)
            options = flight.FlightCallOptions(headers=[token])
            before = peak_mb(pid)
            began = time.perf_counter()
            command = fsql.pack(fsql.new("CommandStatementQuery", query="SELECT * FROM big"))
            info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
            reader = client.do_get(info.endpoints[0].ticket, options)
            first_ms = None
            got_rows = got_bytes = 0
            for chunk in reader:
                if first_ms is None:
                    first_ms = 1000 * (time.perf_counter() - began)
                got_rows += chunk.data.num_rows
                got_bytes += chunk.data.nbytes
            seconds = time.perf_counter() - began
            after = peak_mb(pid)
        assert got_rows == rows, (got_rows, rows)
        print(f"read {got_rows:,} rows, {got_bytes / 1e9:.2f} GB, through the service in "
              f"{seconds:.1f} s; first batch after {first_ms:.0f} ms; the service's peak "
              f"resident memory {before:.0f} MB before, {after:.0f} MB after "
              f"(stream_buffer_mb={args.buffer_mb})")  # fmt: skip
        print(
            f"answer_gb={got_bytes / 1e9:.2f} service_peak_mb={after:.0f} "
            f"ttfb_ms={first_ms:.0f} answer_mb_s={got_bytes / 1e6 / seconds:.0f}"
        )


if __name__ == "__main__":
    main()
