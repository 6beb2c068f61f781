"""The distribution hash is part of the on-disk format: it must never change."""

import datetime
import itertools
import random

import numpy as np
import pyarrow as pa
import pytest

from shardflow.catalog.buckets import (
    bucket_of,
    buckets_of_values,
    hash_keys,
    key_family,
    split_range,
)


def test_integer_hash_is_pinned() -> None:
    hashed = hash_keys(pa.array([0, 1, 2, -1, 2**40], pa.int64()))
    assert [int(h) for h in hashed] == [
        16294208416658607535,
        10451216379200822465,
        10905525725756348110,
        16490336266968443936,
        2296115805719413641,
    ]


def test_string_hash_is_pinned_and_null_is_zero() -> None:
    hashed = hash_keys(pa.array(["", "a", "shardflow", None]))
    assert [int(h) for h in hashed] == [
        13020603013274838756,
        3405396810240292928,
        17008480720746285691,
        0,
    ]


@pytest.mark.parametrize("width", [pa.int8(), pa.int16(), pa.int32(), pa.uint32(), pa.int64()])
def test_integer_widths_hash_alike(width: pa.DataType) -> None:
    values = [1, 2, 3, 100]
    assert np.array_equal(hash_keys(pa.array(values, width)), hash_keys(pa.array(values)))


def test_string_kinds_hash_alike() -> None:
    values = ["x", "yy", None]
    expected = hash_keys(pa.array(values, pa.string()))
    assert np.array_equal(hash_keys(pa.array(values, pa.large_string())), expected)
    assert np.array_equal(hash_keys(pa.array(values, pa.string_view())), expected)


def test_temporal_units_hash_alike() -> None:
    moment = datetime.datetime(2020, 1, 1, 12, 30)
    ms = hash_keys(pa.array([moment], pa.timestamp("ms")))
    us = hash_keys(pa.array([moment], pa.timestamp("us")))
    assert np.array_equal(ms, us)
    day = datetime.date(2020, 1, 1)
    assert np.array_equal(
        hash_keys(pa.array([day], pa.date32())), hash_keys(pa.array([day], pa.date64()))
    )


def test_chunked_and_plain_arrays_agree() -> None:
    chunked = pa.chunked_array([[1, 2], [3, 4]])
    assert np.array_equal(hash_keys(chunked), hash_keys(pa.array([1, 2, 3, 4])))


def test_buckets_spread_evenly() -> None:
    buckets = bucket_of(pa.array(np.arange(256_000)), 256)
    counts = np.bincount(buckets, minlength=256)
    assert buckets.min() >= 0 and buckets.max() < 256
    assert counts.min() > 850 and counts.max() < 1150  # 1000 each, +-15 %


def test_unhashable_key_type_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot be a distribution key"):
        key_family(pa.list_(pa.int64()))


def test_split_range_covers_without_gaps() -> None:
    ranges = split_range(0, 256, 6)
    assert ranges[0][0] == 0 and ranges[-1][1] == 256
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert {hi - lo for lo, hi in ranges} <= {42, 43}
    with pytest.raises(ValueError):
        split_range(0, 4, 5)


def test_a_few_values_hash_to_the_buckets_of_a_column_holding_them() -> None:
    rng = random.Random(7)
    numbers = [0, 1, -1, 2**63 - 1, -(2**63), *(rng.randrange(-(2**63), 2**63) for _ in range(500))]
    for n_buckets in (1, 7, 256, 1 << 20):
        expected = bucket_of(pa.array(numbers, pa.int64()), n_buckets).tolist()
        assert buckets_of_values(numbers, n_buckets) == expected
        small = [n for n in numbers if -(2**31) <= n < 2**31]
        assert (
            buckets_of_values(small, n_buckets)
            == bucket_of(pa.array(small, pa.int32()), n_buckets).tolist()
        )
    words = ["", "a", "it's", "ünïcode ✓", *(f"key-{rng.random()}" for _ in range(200))]
    assert buckets_of_values(words, 256) == bucket_of(pa.array(words), 256).tolist()
