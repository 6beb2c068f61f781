"""The nemesis's full disk: a local cluster whose data directory is a small tmpfs this test
mounts, filled up twice for a while under the drill's checked workload. Inserts meanwhile
are refused with ``StorageError`` (nothing of them kept) and tried again with the same
batch id until they land; none fails for good, no row is lost or doubled, no read misses an
acknowledged row, and writes resume as soon as there is room, without a restart."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardflow.tools.localcluster import LocalRayCluster
from tests.cluster.test_multinode import run_drill
from tests.support.disks import small_tmpfs

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root"),
]


@pytest.fixture
def on_small_disk(tmp_path: Path) -> Iterator[LocalRayCluster]:
    with small_tmpfs(tmp_path / "disk", "256m") as mount:
        local = LocalRayCluster(mount / "data")
        local.up(2)
        try:
            yield local
        finally:
            local.down()


def test_a_full_data_directory_refuses_inserts_until_it_has_room(
    on_small_disk: LocalRayCluster,
) -> None:
    report, out, off_loopback = run_drill(
        on_small_disk, "--rows", "5000", "--moves", "0",
        "--nemesis", "disk", "--faults", "2", "--seed", "1",
    )  # fmt: skip
    assert [f.split(" (")[0] for f in report["faults"]] == ["disk data-dir"] * 2, out
    assert report["refused_inserts"] > 0, "no insert met the full disk"
    assert report["failed_ops"] == 0, report["failures"]
    assert report["lost_rows"] == report["duplicated_rows"] == report["stale_reads"] == 0, out
    assert report["wrong_answers"] == 0, report["failures"]
    assert max(report["fault_recovery_s"]) < 10, out
    assert off_loopback == [], off_loopback[:5]
