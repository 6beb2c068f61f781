"""The Flight SQL service against its baselines, in one run.

The service runs as ``shardflow serve`` in a process of its own, as clients meet it.
Fetch: ``SELECT * FROM lineitem`` through its Flight SQL door (the ADBC
Flight SQL driver as client: the query runs over the shards, the answer streams back)
against a plain ``pyarrow.flight`` DoGet of the same Arrow table from a trivial server that
holds it in memory. QPS: short queries through Flight SQL (ADBC, one connection per client
thread) against the same queries through the in-process API, 4 client threads each.

Time to first batch: ``SELECT * FROM lineitem`` through ``pyarrow.flight`` (GetFlightInfo,
then DoGet until its first record batch arrives), the best of ``--repeat``.

The same fetch with ``pyarrow.flight`` reading every endpoint at once is printed beside it
(ADBC's driver reads endpoints at once too, but hands their batches over in the
endpoints' order, a few queued per endpoint).

``--endpoints workers`` (the default) serves with ``flight_endpoints=workers``: a scan's
parts are read straight from the workers, every worker at once (ADBC's driver reads the
endpoints together); ``--endpoints service`` sends every answer through the service.

Sorted: ``SELECT * FROM lineitem ORDER BY l_extendedprice DESC`` through ``pyarrow.flight``
(the service interleaves the workers' sorted parts as they arrive), timed to its first batch
and to its end against DuckDB's own ORDER BY of the same table in process, with the
service's peak memory (its process's high-water mark, read before and after) against the
answer's size: ``--buffer-mb`` (``stream_buffer_mb``, 64 by default) bounds what waits there.

The last line is ``flight_fetch_ratio=X flight_qps_ratio=Y ttfb_ms=T`` (the ratios:
shardflow / baseline).

    python bench/serve.py --sf 1
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import adbc_driver_flightsql.dbapi as flight_sql
import duckdb
import pyarrow as pa
import pyarrow.flight as flight

import shardflow
from shardflow import tpch
from shardflow.flightsql import wire as fsql
from shardflow.service.auth import AuthStore

USER, PASSWORD = "bench", "bench-password"
SHORT_QUERIES = [
    "SELECT o_orderstatus, o_totalprice FROM orders WHERE o_orderkey = {k}",
    "SELECT count(*) FROM lineitem WHERE l_orderkey = {k}",
    "SELECT c_name, c_acctbal FROM customer WHERE c_custkey = {c}",
    "SELECT n_name FROM nation WHERE n_nationkey = {n}",
]


class TableServer(flight.FlightServerBase):  # type: ignore[misc]
    """The baseline: DoGet streams a table it already holds."""

    def __init__(self, table: pa.Table) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.table = table

    def do_get(self, context: object, ticket: flight.Ticket) -> flight.RecordBatchStream:
        return flight.RecordBatchStream(self.table)


def best_of(repeat: int, run: Callable[[], int]) -> tuple[float, int]:
    """(best seconds, bytes) of ``repeat`` runs."""
    timings = []
    size = 0
    for _ in range(repeat):
        started = time.perf_counter()
        size = run()
        timings.append(time.perf_counter() - started)
    return min(timings), size


def qps(threads: int, seconds: float, make_client: Callable[[], Callable[[int], object]]) -> float:
    """Queries per second of ``threads`` clients, each running short queries for
    ``seconds``."""
    done = [0] * threads
    stop = threading.Event()

    def client(index: int) -> None:
        run = make_client()
        i = index
        run(i)  # warm: connection, plan cache
        while not stop.is_set():
            run(i)
            done[index] += 1
            i += threads

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(client, i) for i in range(threads)]
        time.sleep(1.0)  # every client connected and warm
        before = sum(done)
        started = time.perf_counter()
        time.sleep(seconds)
        count = sum(done) - before
        elapsed = time.perf_counter() - started
        stop.set()
        for future in futures:
            future.result()
    return count / elapsed


def short_query(i: int) -> str:
    template = SHORT_QUERIES[i % len(SHORT_QUERIES)]
    return template.format(k=1 + (i * 7919) % 6_000_000, c=1 + i % 1000, n=i % 25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="fetch runs (best counts)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="per QPS measurement")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    parser.add_argument("--endpoints", choices=("workers", "service"), default="workers")
    parser.add_argument("--buffer-mb", type=int, default=64, help="the service's stream_buffer_mb")
    args = parser.parse_args()
    data = tpch.generate(args.sf, args.home / f"tpch-sf{args.sf:g}")
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-serve-") as data_dir:
        AuthStore(data_dir).add_user(USER, "reader", PASSWORD)
        # the in-process side first; then the same data directory served by its own process
        with shardflow.connect(workers=args.workers, data_dir=data_dir) as db:
            tpch.load(db, data, progress=True)
            lineitem = db.sql("SELECT * FROM lineitem")
            local_qps = qps(args.threads, args.seconds, lambda: lambda i: db.sql(short_query(i)))
        with served(data_dir, args.workers, args.endpoints, args.buffer_mb) as (uri, pid):
            sorted_fetch(uri, pid, lineitem)
            run_bench(args, uri, lineitem, local_qps)


@contextmanager
def served(
    data_dir: str, workers: int, endpoints: str = "service", buffer_mb: int = 64
) -> Iterator[tuple[str, int]]:
    """``shardflow serve`` on ``data_dir`` in a process of its own; yields its address and
    process id."""
    command = [str(Path(sys.executable).parent / "shardflow"), "serve", "--data-dir", data_dir,
               "--flight-port", "0", "--workers", str(workers),
               "--set", f"flight_endpoints={endpoints}",
               "--set", f"stream_buffer_mb={buffer_mb}"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "Flight SQL on " in line:
                yield line.split("Flight SQL on ", 1)[1].strip(), process.pid
                break
        else:
            raise SystemExit(f"shardflow serve exited with {process.wait()}")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def peak_mb(pid: int) -> float:
    """The process's resident memory high-water mark (Linux: VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sorted_fetch(uri: str, pid: int, lineitem: pa.Table) -> None:
    """An ORDER BY of the whole table through the service, against DuckDB's in process."""
    query = "SELECT * FROM lineitem ORDER BY l_extendedprice DESC"
    client = flight.FlightClient(uri)
    options = flight.FlightCallOptions(headers=[client.authenticate_basic_token(USER, PASSWORD)])
    before = peak_mb(pid)
    started = time.perf_counter()
    command = fsql.pack(fsql.new("CommandStatementQuery", query=query))
    info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
    reader = reader_of(client, info.endpoints[0]).do_get(info.endpoints[0].ticket, options)
    first = rows = nbytes = 0.0
    for chunk in reader:
        if not first:
            first = time.perf_counter() - started
        rows += chunk.data.num_rows
        nbytes += chunk.data.nbytes
    took = time.perf_counter() - started
    client.close()
    con = duckdb.connect()
    con.register("lineitem", lineitem)
    started = time.perf_counter()
    con.sql(query).to_arrow_table()
    duck = time.perf_counter() - started
    con.close()
    print(f"{query} ({rows:.0f} rows, {nbytes / 1e6:.0f} MB) through the service:")
    print(f"  first batch after {first * 1e3:.0f} ms, all in {took:.2f}s "
          f"(DuckDB in process: {duck:.2f}s; ratio {took / duck:.2f})")  # fmt: skip
    print(f"  the service's peak memory {before:.0f} -> {peak_mb(pid):.0f} MB")


def reader_of(client: flight.FlightClient, endpoint: flight.FlightEndpoint) -> flight.FlightClient:
    """The client that reads ``endpoint``: the service's, or one at the worker it names."""
    return flight.FlightClient(endpoint.locations[0]) if endpoint.locations else client


def run_bench(args: argparse.Namespace, uri: str, lineitem: pa.Table, local_qps: float) -> None:
    credentials = {"username": USER, "password": PASSWORD}
    conn = flight_sql.connect(uri, db_kwargs=credentials, autocommit=True)

    def through_flight_sql() -> int:
        with conn.cursor() as cur:
            cur.execute("SELECT * FROM lineitem")
            return int(cur.fetch_arrow_table().nbytes)

    baseline = TableServer(lineitem)
    plain = flight.FlightClient(f"grpc://127.0.0.1:{baseline.port}")

    def through_plain_flight() -> int:
        return int(plain.do_get(flight.Ticket(b"lineitem")).read_all().nbytes)

    def through_pyarrow() -> int:
        """The same answer read with ``pyarrow.flight``: every endpoint at once."""
        client = flight.FlightClient(uri)
        options = flight.FlightCallOptions(
            headers=[client.authenticate_basic_token(USER, PASSWORD)]
        )
        command = fsql.pack(fsql.new("CommandStatementQuery", query="SELECT * FROM lineitem"))
        info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)

        def read(endpoint: flight.FlightEndpoint) -> pa.Table:
            return reader_of(client, endpoint).do_get(endpoint.ticket, options).read_all()

        with ThreadPoolExecutor(len(info.endpoints)) as pool:
            nbytes = sum(part.nbytes for part in pool.map(read, info.endpoints))
        client.close()
        return int(nbytes)

    def first_batch() -> int:
        client = flight.FlightClient(uri)
        options = flight.FlightCallOptions(
            headers=[client.authenticate_basic_token(USER, PASSWORD)]
        )
        started = time.perf_counter()
        command = fsql.pack(fsql.new("CommandStatementQuery", query="SELECT * FROM lineitem"))
        info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
        reader = reader_of(client, info.endpoints[0]).do_get(info.endpoints[0].ticket, options)
        reader.read_chunk()
        took = time.perf_counter() - started
        reader.cancel()
        client.close()
        return int(took * 1e6)

    ttfb_ms = min(first_batch() for _ in range(args.repeat)) / 1e3
    served_s, size = best_of(args.repeat, through_flight_sql)
    plain_s, plain_size = best_of(args.repeat, through_plain_flight)
    pyarrow_s, _ = best_of(args.repeat, through_pyarrow)
    assert size == plain_size, (size, plain_size)
    baseline.shutdown()
    plain.close()
    conn.close()
    mb = size / 1e6
    rows = lineitem.num_rows
    print(f"SELECT * FROM lineitem ({rows} rows, {mb:.0f} MB; endpoints: {args.endpoints}):")
    print(f"  Flight SQL (ADBC): {served_s:.2f}s = {mb / served_s:.0f} MB/s")
    print(f"  plain DoGet of the table: {plain_s:.2f}s = {mb / plain_s:.0f} MB/s")
    print(f"  pyarrow.flight, its endpoints read at once: {pyarrow_s:.2f}s = "
          f"{mb / pyarrow_s:.0f} MB/s (ratio {plain_s / pyarrow_s:.2f})")  # fmt: skip
    print(f"  first batch through pyarrow.flight after {ttfb_ms:.0f} ms")

    def flight_client() -> Callable[[int], object]:
        connection = flight_sql.connect(uri, db_kwargs=credentials, autocommit=True)
        cursor = connection.cursor()  # kept, as an application keeps its cursor

        def run(i: int) -> object:
            cursor.execute(short_query(i))
            return cursor.fetch_arrow_table()

        return run

    def pyarrow_client() -> Callable[[int], object]:
        client = flight.FlightClient(uri)
        options = flight.FlightCallOptions(
            headers=[client.authenticate_basic_token(USER, PASSWORD)]
        )

        def run(i: int) -> object:
            command = fsql.pack(fsql.new("CommandStatementQuery", query=short_query(i)))
            info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
            return [
                reader_of(client, e).do_get(e.ticket, options).read_all() for e in info.endpoints
            ]

        return run

    served_qps = qps(args.threads, args.seconds, flight_client)
    pyarrow_qps = qps(args.threads, args.seconds, pyarrow_client)
    print(f"short queries, {args.threads} client threads:")
    print(f"  Flight SQL (ADBC): {served_qps:.0f} queries/s")
    print(f"  Flight SQL (pyarrow.flight client): {pyarrow_qps:.0f} queries/s")
    print(f"  in-process API: {local_qps:.0f} queries/s")
    fetch_ratio = (mb / served_s) / (mb / plain_s)
    print(
        f"flight_fetch_ratio={fetch_ratio:.2f} flight_qps_ratio={served_qps / local_qps:.2f} "
        f"ttfb_ms={ttfb_ms:.0f}"
    )


if __name__ == "__main__":
    main()
