"""The fast lane's wire: length-prefixed frames, a status byte before each answer, rows as
Arrow IPC streams (:func:`to_wire`), and what the lane's two ends agree on."""

from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Iterator

import pyarrow as pa

from shardflow.errors import ClusterError

_LENGTH = struct.Struct("!Q")
OK = b"\x00"
FAILED = b"\x01"
TOKEN_BYTES = 16
MAX_REQUEST_BYTES = 256 << 20
"""The longest request a worker reads (a fragment's SQL, IN lists included)."""
ARROW_FRAME_BYTES = 1 << 20
"""Frames of rows this large or larger are received into Arrow's memory (see read_rows)."""
MAX_PART_BYTES = 4 << 30
"""The largest part of a load a worker reads (one unit's rows of one load batch), or input
of a fragment."""
STREAM_FRAME_BYTES = 4 << 20
"""The most bytes of one part of a streamed result (``Lanes.stream``): the size of the
record batches a Flight client gets (ADBC refuses gRPC messages over 16 MiB)."""
CONNECT_TIMEOUT_S = 2.0
MOVE_STEPS = frozenset({"chunk", "fence", "retire", "finish"})
"""What a move's target and the coordinator ask a source over its lane."""


def to_wire(table: pa.Table) -> pa.Buffer:
    """A fragment's result as one Arrow IPC buffer, for Ray and the fast lane alike: Ray
    pickles an Arrow table column by column and buffer by buffer in Python (~0.4 ms for a
    one-row, nine-column answer, more than the query), an IPC buffer in one piece (~0.02 ms
    each way)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def slices(table: pa.Table, limit: int) -> Iterator[pa.Table]:
    """``table`` in slices of about ``limit`` bytes at most (by the average row's size);
    one, empty, for a table without rows."""
    rows = max(1, limit * table.num_rows // max(1, table.nbytes))
    if table.num_rows == 0:
        yield table
    for offset in range(0, table.num_rows, rows):
        yield table.slice(offset, rows)


def from_wire(value: pa.Table | pa.Buffer | bytes | bytearray) -> pa.Table:
    """A result sent by :func:`to_wire` (or a table put as it is) as a table."""
    if isinstance(value, pa.Table):
        return value
    with pa.ipc.open_stream(pa.py_buffer(value)) as reader:
        return reader.read_all()


def write_frames(connection: socket.socket, *frames: bytes | pa.Buffer) -> None:
    if sum(len(frame) for frame in frames) < 1 << 16:  # one write: no wait between parts
        connection.sendall(b"".join(_LENGTH.pack(len(f)) + bytes(f) for f in frames))
        return
    for frame in frames:
        connection.sendall(_LENGTH.pack(len(frame)))
        connection.sendall(memoryview(frame))


def read_frame(connection: socket.socket, limit: int | None = None) -> bytearray:
    return read_exactly(connection, _frame_length(connection, limit))


def read_rows(connection: socket.socket, limit: int | None = None) -> pa.Table:
    """A frame of Arrow IPC as a table over the bytes received. A large one is received
    into memory of Arrow's allocator, which hands it back to the system once the table is
    gone: in a bytearray, glibc's allocator kept most of a load's parts (~50 MB a worker
    for TPC-H SF 1 lineitem and orders)."""
    return _rows(connection, _frame_length(connection, limit))


def read_part(connection: socket.socket) -> pa.Table | Exception | None:
    """The next of a streamed fragment's frames: a part of its rows, the worker's error, or
    None after the last part."""
    tag = read_frame(connection)
    if not tag:
        return None
    if tag == FAILED:
        error = pickle.loads(read_frame(connection))
        return error if isinstance(error, Exception) else ClusterError(repr(error))
    return read_rows(connection)


def read_rows_or_none(connection: socket.socket) -> pa.Table | None:
    """A frame of :func:`read_rows`, or None for an empty frame."""
    length = _frame_length(connection)
    return _rows(connection, length) if length else None


def _frame_length(connection: socket.socket, limit: int | None = None) -> int:
    (length,) = _LENGTH.unpack(read_exactly(connection, _LENGTH.size))
    if limit is not None and length > limit:
        raise ValueError(f"a frame of {length} bytes is over {limit}")
    return int(length)


def _rows(connection: socket.socket, length: int) -> pa.Table:
    if length < ARROW_FRAME_BYTES:
        return from_wire(read_exactly(connection, length))
    buffer = pa.allocate_buffer(length)
    _receive_into(connection, memoryview(buffer))
    return from_wire(buffer)


def read_exactly(connection: socket.socket, length: int) -> bytearray:
    data = bytearray(length)
    _receive_into(connection, memoryview(data))
    return data


def _receive_into(connection: socket.socket, view: memoryview) -> None:
    while view:
        received = connection.recv_into(view)
        if received == 0:
            raise EOFError("the connection closed")
        view = view[received:]
