"""The audit log lasts: a hash chain shows a line removed, edited or moved (each tried on
real files), the log rotates by size and by age with the chain running on across files,
writers in several processes append whole chained lines, and a log others can read is
refused."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from shardflow.audit import GENESIS, AuditLog
from shardflow.errors import ConfigError


def filled(folder: Path, count: int = 6, **options: float) -> AuditLog:
    log = AuditLog(folder, **options)  # type: ignore[arg-type]
    for i in range(count):
        log.record(f"user{i}", "migrate", {"shard": f"t#{i}"}, "ok", 0.001 * i)
    return log


def test_an_intact_chain_verifies(tmp_path: Path) -> None:
    log = filled(tmp_path)
    found = log.verify()
    assert (found.entries, found.torn, found.broken) == (6, 0, None)
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert lines[0]["prev"] == GENESIS
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(lines))


@pytest.mark.parametrize(
    ("tamper", "where"),
    [
        ("remove", "audit.jsonl:3: the chain breaks"),
        ("edit", "audit.jsonl:3: this line was edited"),
        ("move", "audit.jsonl:3: the chain breaks"),
        ("rehash", "audit.jsonl:4: the chain breaks"),
    ],
)
def test_a_line_removed_edited_or_moved_breaks_the_chain(
    tmp_path: Path, tamper: str, where: str
) -> None:
    log = filled(tmp_path)
    lines = log.path.read_text().splitlines()
    if tamper == "remove":
        del lines[2]
    elif tamper == "move":
        lines[2], lines[4] = lines[4], lines[2]
    else:  # an outcome rewritten; "rehash": its hash made again to match, as a forger would
        entry = json.loads(lines[2])
        entry["outcome"] = "denied: needs operator"
        if tamper == "rehash":
            from shardflow.audit import _entry_hash

            entry["hash"] = _entry_hash(entry)
        lines[2] = json.dumps(entry)
    log.path.write_text("\n".join(lines) + "\n")
    broken = log.verify().broken
    assert broken is not None and broken.startswith(where), broken


def test_a_line_torn_by_a_crash_is_skipped_and_the_chain_runs_on(tmp_path: Path) -> None:
    log = filled(tmp_path, 2)
    with log.path.open("ab") as out:
        out.write(b'{"time": "2025-01-01T12:00:00+00:00", "who": "bo')
    log.record("after", "rebalance", {}, "ok", 0.0)
    found = log.verify()
    assert (found.entries, found.torn, found.broken) == (3, 1, None)
    assert [e["who"] for e in log.entries()] == ["user0", "user1", "after"]


def test_the_log_rotates_by_size_and_by_age_and_the_chain_runs_on(tmp_path: Path) -> None:
    log = filled(tmp_path, 20, max_bytes=1500, max_age_s=0)
    assert len(log.files()) > 2 and log.files()[-1] == log.path
    assert all(p.name.startswith("audit-") for p in log.files()[:-1])
    assert log.verify() == type(log.verify())(20, 0, None)
    assert [e["who"] for e in log.entries()] == [f"user{i}" for i in range(20)]
    aged = AuditLog(tmp_path / "aged", max_bytes=1 << 30, max_age_s=3600)
    aged.record("old", "drain", {}, "ok", 0.0, when=datetime.now(UTC) - timedelta(hours=2))
    aged.record("new", "drain", {}, "ok", 0.0)  # the file's first entry is 2 h old: rotated
    assert len(aged.files()) == 2 and aged.verify().broken is None
    first = json.loads(aged.path.read_text().splitlines()[0])
    assert first["who"] == "new" and first["prev"] != GENESIS  # the chain ran on


def _append(folder: str, who: str) -> None:
    log = AuditLog(folder, max_bytes=4000)
    for i in range(40):
        log.record(who, "ingest", {"table": "t", "i": i, "pad": "x" * 200}, "ok", 0.0)


def test_writers_in_several_processes_keep_one_chain(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append, args=(str(tmp_path), f"p{n}")) for n in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    log = AuditLog(tmp_path)
    found = log.verify()
    assert (found.entries, found.broken) == (120, None), found
    for n in range(3):
        mine = [e["arguments"]["i"] for e in log.entries() if e["who"] == f"p{n}"]
        assert mine == list(range(40))


def test_a_log_others_can_read_is_refused(tmp_path: Path) -> None:
    log = filled(tmp_path, 1)
    log.check_private()
    assert oct(os.stat(log.path).st_mode & 0o777) == oct(0o600)
    os.chmod(log.path, 0o644)
    with pytest.raises(ConfigError, match=r"open to others .*chmod 600"):
        log.check_private()
