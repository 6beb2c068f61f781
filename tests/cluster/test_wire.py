"""The roles' messages carry their version (``runtime/wire.py``): a worker that speaks one
too far from the coordinator's release is refused when it is admitted, with an error that
names both, and never serves; one a release apart serves (N and N-1 together)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import shardflow
from shardflow.runtime.wire import PROTOCOL

pytestmark = pytest.mark.cluster


def test_a_worker_two_releases_apart_is_refused_and_one_apart_serves(tmp_path: Path) -> None:
    with pytest.raises(shardflow.ConfigError, match=f"speaks protocol {PROTOCOL + 2} and this "
                       f"coordinator {PROTOCOL}"):  # fmt: skip
        shardflow.connect(workers=1, data_dir=tmp_path / "far", test_protocol=PROTOCOL + 2)
    with shardflow.connect(
        workers=1, data_dir=tmp_path / "near", test_protocol=PROTOCOL + 1
    ) as db:  # the next release's worker beside this coordinator
        db.create_table("t", pa.table({"id": [1, 2, 3]}), distributed_by="id")
        assert db.sql("SELECT sum(id) AS s FROM t").to_pylist() == [{"s": 6}]
