"""What a restore as of a time takes of the log (``storage/point_in_time.py``), on plain
records: whole batches only, and the backups around the time chosen or refused."""

from __future__ import annotations

from typing import Any

import pytest

from shardflow.errors import StorageError
from shardflow.storage.point_in_time import _around, _Entry, _whole_batches_by

TABLE = "tables/t"
FOLDERS = {f"{TABLE}/0", f"{TABLE}/1"}


def part(
    unit: int, batch: str, logged_at: float, routed: tuple[int, ...] | None = (0, 1)
) -> _Entry:
    rel = f"{TABLE}/{unit}/wal-000000000002-{batch}.arrow"
    units = None if routed is None else list(routed)
    return _Entry(rel, f"{TABLE}/{unit}", 2, batch, logged_at, units, {})


def taken(entries: list[_Entry], at: float, in_base: dict[str, set[str]] | None = None) -> set[str]:
    """The parts taken, as ``batch@unit``."""
    bases = {folder: (1, (in_base or {}).get(folder, set())) for folder in FOLDERS}
    names = {e.rel: f"{e.batch}@{e.folder.rsplit('/', 1)[1]}" for e in entries}
    return {names[rel] for rel in _whole_batches_by(entries, FOLDERS, bases, at)}


def test_a_batch_written_in_part_by_the_time_is_taken_whole() -> None:
    """Its parts reach their shards one after the other: one before the time, one after."""
    entries = [part(0, "a", 9.0), part(1, "a", 10.5), part(0, "b", 10.2), part(1, "b", 10.3)]
    assert taken(entries, 10.0) == {"a@0", "a@1"}


def test_a_batch_a_unit_lacks_is_left_out_whole_unless_its_checkpoint_holds_it() -> None:
    entries = [part(0, "a", 9.0)]
    assert taken(entries, 10.0) == set()
    assert taken(entries, 10.0, {f"{TABLE}/1": {"a"}}) == {"a@0"}
    assert taken([part(0, "r", 9.0, routed=None)], 10.0) == {"r@0"}  # not said: by time


def manifest(
    backup_id: str, started: float, finished: float, since: float | None
) -> dict[str, Any]:
    return {
        "id": backup_id,
        "started_at": started,
        "finished_at": finished,
        "keep_log_since": since,
    }


def test_the_backups_around_a_time_or_why_none() -> None:
    taken_ = [manifest("a", 0, 1, None), manifest("b", 10, 11, 10), manifest("c", 20, 21, 10)]
    assert [m["id"] for m in _around(taken_, 15)] == ["b", "c"]
    for at, why in [
        (0.5, "was finished by"),
        (5, "the log was not kept"),
        (20.5, "falls while backup c ran"),
        (30, "take one"),
    ]:
        with pytest.raises(StorageError, match=why):
            _around(taken_, at)
