"""Stable hashing of distribution keys into virtual buckets, and bucket ranges.

The hash must never change: rows inserted years apart must land in the same bucket for
co-located joins to stay correct. So it is written here (splitmix64 over integers, 64-bit
BLAKE2b over bytes), not borrowed from an engine whose hash may change between versions.
Integers of every width, dates and timestamps hash alike, so ``int32`` and ``int64`` keys
with equal values co-locate.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z ^= z >> np.uint64(31)
    return z


def key_family(arrow_type: pa.DataType) -> str:
    """The hash family of a key type; only keys of one family can be co-located."""
    if (
        pa.types.is_integer(arrow_type)
        or pa.types.is_temporal(arrow_type)
        or pa.types.is_boolean(arrow_type)
    ):
        return "integer"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_string_view(arrow_type):
        return "string"
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "binary"
    if pa.types.is_decimal(arrow_type):
        return "decimal"
    if pa.types.is_floating(arrow_type):
        return "float"
    raise TypeError(f"a column of type {arrow_type} cannot be a distribution key")


def hash_keys(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """64-bit stable hash per row; NULL hashes to 0."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    family = key_family(column.type)
    if family == "integer":
        values = _as_int64(column).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
        hashed = _splitmix64(values)
    elif family == "float":
        as_float = column.cast(pa.float64()).fill_null(0.0)
        hashed = _splitmix64(as_float.to_numpy(zero_copy_only=False).view(np.uint64))
    else:
        if family == "decimal":
            column = pc.cast(column, pa.string())
        hashed = np.fromiter(
            (_hash_bytes(value) for value in column.to_pylist()),
            dtype=np.uint64,
            count=len(column),
        )
    if column.null_count:
        hashed[column.is_null().to_numpy(zero_copy_only=False)] = 0
    return hashed


def _as_int64(column: pa.Array) -> pa.Array:
    """Integers as int64; dates as days, timestamps as microseconds, times and durations in
    their unit, so equal values of different widths and units hash alike."""
    kind = column.type
    if pa.types.is_date(kind):
        return column.cast(pa.date32()).view(pa.int32()).cast(pa.int64())
    if pa.types.is_timestamp(kind):
        return column.cast(pa.timestamp("us", kind.tz)).view(pa.int64())
    if pa.types.is_time32(kind):
        return column.view(pa.int32()).cast(pa.int64())
    if pa.types.is_temporal(kind):
        return column.view(pa.int64())
    return column.cast(pa.int64())


def _hash_bytes(value: str | bytes | None) -> int:
    if value is None:
        return 0
    data = value.encode() if isinstance(value, str) else value
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def bucket_of(column: pa.Array | pa.ChunkedArray, n_buckets: int) -> np.ndarray:
    """The virtual bucket (0 <= b < n_buckets) of every row."""
    return (hash_keys(column) % np.uint64(n_buckets)).astype(np.int32)


_MASK = (1 << 64) - 1


def _splitmix64_scalar(value: int) -> int:
    """:func:`_splitmix64` of one integer, in plain Python (for a few constants, where
    building arrays costs far more than hashing)."""
    z = ((value & _MASK) + int(_GOLDEN)) & _MASK
    z = ((z ^ (z >> 30)) * int(_M1)) & _MASK
    z = ((z ^ (z >> 27)) * int(_M2)) & _MASK
    return z ^ (z >> 31)


def buckets_of_values(values: list[int] | list[str], n_buckets: int) -> list[int]:
    """The bucket of each of a few integer or string key values, as :func:`bucket_of`
    computes for a column holding them (a routed query's constants)."""
    return [
        (_hash_bytes(v) if isinstance(v, str) else _splitmix64_scalar(v)) % n_buckets
        for v in values
    ]


def split_range(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """Cut [lo, hi) into ``parts`` contiguous ranges of near-equal width."""
    if parts < 1 or parts > hi - lo:
        raise ValueError(f"cannot cut bucket range [{lo}, {hi}) into {parts} parts")
    width, extra = divmod(hi - lo, parts)
    ranges = []
    start = lo
    for index in range(parts):
        end = start + width + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
