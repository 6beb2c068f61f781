"""A table's source, read once: a Parquet file or directory (a path or a pyarrow filesystem
URI), a ``pyarrow.Table`` or an Arrow stream (anything with ``__arrow_c_stream__``), as a
schema, a row count where known before reading, and batches of at most a given size. What
cannot be read is refused before anything is written."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from shardflow.errors import TableError


def open_source(
    source: object, batch_rows: int
) -> tuple[pa.Schema, int | None, Iterator[pa.RecordBatch]]:
    """The source's schema, its row count where known before reading (a stream's is not),
    and its rows in batches of at most ``batch_rows``."""
    if isinstance(source, pa.RecordBatch):
        source = pa.Table.from_batches([source])
    if isinstance(source, pa.Table):
        return source.schema, source.num_rows, iter(source.to_batches(max_chunksize=batch_rows))
    if hasattr(source, "__arrow_c_stream__"):  # a RecordBatchReader, DuckDB, Polars, ...
        try:
            reader = (
                source
                if isinstance(source, pa.RecordBatchReader)
                else pa.RecordBatchReader.from_stream(source)
            )
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise TableError(f"cannot read an Arrow stream from the source: {error}") from None
        return reader.schema, None, _stream_batches(reader, batch_rows)
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if "://" not in path and not Path(path).exists():
            raise TableError(f"source {path!r} does not exist")
        try:
            dataset = ds.dataset(path, format="parquet")
            schema = _one_schema(path, dataset)
            total = dataset.count_rows()
        except (pa.ArrowInvalid, OSError) as error:
            raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
        return schema, total, _read_batches(path, dataset, batch_rows)
    raise TableError(
        "a table source is a Parquet file or directory (path or URI), a pyarrow.Table or an "
        f"Arrow stream (a RecordBatchReader, a DuckDB relation, ...), not {type(source).__name__}"
    )


def arrow_size(
    source: object, total: int | None, batches: Iterator[pa.RecordBatch]
) -> tuple[int | None, Iterator[pa.RecordBatch]]:
    """The source's size in Arrow bytes where it can be told before the load (None for a
    stream), and its batches again: a Parquet source's is its row count times the bytes a
    row of its first batch takes, the one batch read ahead for it."""
    if isinstance(source, pa.RecordBatch | pa.Table):
        return source.nbytes, batches
    if total is None:
        return None, batches
    first = next(batches, None)
    if first is None:
        return 0, batches
    size = total * first.nbytes // max(first.num_rows, 1)
    return size, itertools.chain([first], batches)


def _one_schema(path: str, dataset: ds.FileSystemDataset) -> pa.Schema:
    """The schema every file of the source has; a source without files, or whose files
    disagree, is refused before anything is written."""
    fragments = list(dataset.get_fragments())
    if not fragments:
        raise TableError(f"source {path!r} holds no Parquet files")
    first = fragments[0].physical_schema.remove_metadata()
    for fragment in fragments[1:]:
        other = fragment.physical_schema.remove_metadata()
        if not other.equals(first):
            differ = sorted(
                {f"{f.name} {f.type}" for f in first} ^ {f"{f.name} {f.type}" for f in other}
            )
            raise TableError(
                f"the files of source {path!r} have different schemas: {fragments[0].path} and "
                f"{fragment.path} differ in {', '.join(differ)}"
            )
    return first


def _stream_batches(reader: pa.RecordBatchReader, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """A stream's batches cut to at most ``batch_rows`` (a producer may send one batch of
    millions of rows); small batches pass as they come, so a slow producer's rows are sent
    as they arrive. A batch must have the stream's schema (pyarrow does not check what a
    Python producer yields)."""
    with reader:
        for batch in reader:
            if not batch.schema.equals(reader.schema):
                raise TableError(
                    f"a batch of the stream does not have the stream's schema: {batch.schema} "
                    f"(the stream's: {reader.schema})".replace("\n", ", ")
                )
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)


def _read_batches(
    path: str, dataset: ds.FileSystemDataset, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    try:
        yield from dataset.to_batches(batch_size=batch_rows)
    except (pa.ArrowInvalid, OSError) as error:
        raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
