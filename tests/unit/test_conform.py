"""Inserted data is checked against the table before anything is written."""

import pyarrow as pa
import pytest

from shardflow.errors import SchemaMismatchError
from shardflow.storage.conform import conform

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("price", pa.decimal128(15, 2)),
        pa.field("name", pa.string()),
    ]
)


def test_reorders_columns_and_widens_integers() -> None:
    data = pa.table(
        {
            "name": pa.array(["a"], pa.string_view()),
            "price": pa.array([3], pa.int32()),
            "id": pa.array([1], pa.int16()),
        }
    )
    result = conform(data, SCHEMA, "t")
    assert result.schema.equals(SCHEMA)
    assert result.to_pylist() == [{"id": 1, "price": pytest.approx(3), "name": "a"}]


def test_record_batches_are_accepted() -> None:
    batch = pa.record_batch({"id": [1], "price": [None], "name": [None]})
    assert conform(batch, SCHEMA, "t").num_rows == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (pa.table({"id": [1], "price": [1]}), "missing column"),
        (pa.table({"id": [1], "price": [1], "name": ["a"], "x": [1]}), "unknown column"),
        (pa.table({"id": ["1"], "price": [1], "name": ["a"]}), "has type string"),
        (pa.table({"id": [1.5], "price": [1], "name": ["a"]}), "has type double"),
        (pa.table({"id": [None], "price": [1], "name": ["a"]}), "NOT NULL"),
        (pa.table({"id": [1], "price": [10**18], "name": ["a"]}), "does not fit"),
        ({"id": [1]}, "pyarrow.Table"),
    ],
)
def test_bad_inserts_are_refused_with_a_reason(data: object, message: str) -> None:
    with pytest.raises(SchemaMismatchError, match=message):
        conform(data, SCHEMA, "t")
