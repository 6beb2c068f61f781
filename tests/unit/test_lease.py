"""One owner per data directory: the lease and the fencing epoch every durable write checks.

Real files and real processes: a holder that exited is one that ran and ended here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from shardflow.catalog import Catalog, CatalogStore, DataDir, lease
from shardflow.catalog.lease import Holder, LeaseRecord, acquire, read_lease, release, renew
from shardflow.errors import DataDirInUseError, OwnershipLostError
from shardflow.storage import ShardStore


@pytest.fixture(autouse=True)
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease, "TAKEOVER_GRACE_S", 0.0)


def _data_dir(tmp_path: Path) -> DataDir:
    return DataDir.resolve(str(tmp_path / "data"))


def _acquire_in_a_process_that_exits(tmp_path: Path) -> None:
    code = (
        "import sys; from shardflow.catalog import DataDir, lease;"
        "lease.acquire(DataDir.resolve(sys.argv[1]), 'crashed-cluster', 60.0, 'the old one')"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "data")], check=True)


def test_first_owner_gets_epoch_one_and_keeps_it_when_its_coordinator_restarts(
    tmp_path: Path,
) -> None:
    data_dir = _data_dir(tmp_path)
    token = acquire(data_dir, "cluster-a", 10.0)
    assert token.epoch == 1
    record = read_lease(data_dir)
    assert record is not None and record.holder == Holder.this_process()
    assert acquire(data_dir, "cluster-a", 10.0) == token


def test_a_live_owner_is_never_joined_by_a_second_writer(tmp_path: Path) -> None:
    data_dir = _data_dir(tmp_path)
    acquire(data_dir, "cluster-a", 10.0, "embedded cluster of a test")
    with pytest.raises(DataDirInUseError, match=r"embedded cluster of a test\), pid \d+"):
        acquire(data_dir, "cluster-b", 10.0)


def test_an_owner_that_exited_is_replaced_at_once_with_the_next_epoch(tmp_path: Path) -> None:
    _acquire_in_a_process_that_exits(tmp_path)
    data_dir = _data_dir(tmp_path)
    old = read_lease(data_dir)
    assert old is not None and old.holder.alive() is False and not old.expired(time.time())
    token = acquire(data_dir, "cluster-b", 10.0)
    assert token.epoch == old.epoch + 1


def test_a_remote_owner_is_replaced_only_once_its_lease_expired(tmp_path: Path) -> None:
    data_dir = _data_dir(tmp_path)
    remote = Holder("another-machine", "boot", 4242)
    record = LeaseRecord("cluster-a", 3, remote, time.time(), ttl_s=0.3)
    data_dir.write_atomic(data_dir.path("owner.json"), record.to_json(), fenced=False)
    with pytest.raises(DataDirInUseError, match="expires in"):
        acquire(data_dir, "cluster-b", 10.0)
    time.sleep(0.4)
    assert acquire(data_dir, "cluster-b", 10.0).epoch == 4


def test_a_released_lease_passes_on_and_renewals_notice_the_loss(tmp_path: Path) -> None:
    data_dir = _data_dir(tmp_path)
    first = acquire(data_dir, "cluster-a", 10.0)
    assert renew(data_dir, first)
    release(data_dir, first)
    second = acquire(data_dir, "cluster-b", 10.0)
    assert second.epoch == first.epoch + 1
    assert not renew(data_dir, first)
    assert renew(data_dir, second)


def test_a_process_frozen_inside_a_lease_change_keeps_no_one_waiting_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped while it holds the lease's lock (the milliseconds of a renewal)
    would keep every takeover on this machine waiting until it resumed: the wait is
    bounded, and says so. Here a real stopped process holds it."""
    data_dir = _data_dir(tmp_path)
    holder = acquire(data_dir, "cluster-a", 0.2)
    code = (
        "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDWR);"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True);"
        "os.kill(os.getpid(), signal.SIGSTOP)"
    )
    lock_path = str(tmp_path / "data" / lease.LOCK_FILE)
    frozen = subprocess.Popen([sys.executable, "-c", code, lock_path], stdout=subprocess.PIPE)
    try:
        assert frozen.stdout is not None and frozen.stdout.readline() == b"locked\n"
        monkeypatch.setattr(lease, "LOCK_WAIT_S", 0.3)
        time.sleep(0.3)  # cluster-a's lease expires meanwhile
        with pytest.raises(DataDirInUseError, match="stopped or frozen"):
            acquire(data_dir, "cluster-b", 10.0)
        with pytest.raises(DataDirInUseError, match="stopped or frozen"):
            renew(data_dir, holder)
    finally:
        frozen.kill()
        frozen.communicate()
    assert acquire(data_dir, "cluster-b", 10.0).epoch == holder.epoch + 1  # once it is gone


def test_a_stale_owner_writes_nothing_after_a_takeover(tmp_path: Path) -> None:
    """The old owner hung past its lease; a new one took over. Every kind of durable write
    of the old owner — catalog version, log entry, Parquet base, deletion — is refused and
    leaves the files as they were."""
    plain = _data_dir(tmp_path)
    schema = pa.schema([("k", pa.int64())])
    old = plain.fenced(acquire(plain, "cluster-a", 0.2))
    store = ShardStore(old, "uid", "0")
    store.append_wal(pa.table({"k": [1]}), 1, "batch-1")
    CatalogStore(old).save(Catalog())
    time.sleep(0.3)  # cluster-a stops renewing: it hangs

    new = plain.fenced(acquire(plain, "cluster-b", 10.0))
    before = sorted(p.name for p in (tmp_path / "data").rglob("*") if p.is_file())
    with pytest.raises(OwnershipLostError, match="another cluster"):
        store.append_wal(pa.table({"k": [2]}), 2, "batch-2")
    with pytest.raises(OwnershipLostError):
        store.write_base(pa.table({"k": [1, 2]}), 2, {})
    with pytest.raises(OwnershipLostError):
        CatalogStore(old).save(Catalog(version=7))
    with pytest.raises(OwnershipLostError):
        store.destroy()
    after = sorted(p.name for p in (tmp_path / "data").rglob("*") if p.is_file())
    assert after == before  # nothing written, nothing deleted (no stray temporaries either)

    recovered = ShardStore(new, "uid", "0").recover(schema)
    assert [t.to_pylist() for t in recovered.tables] == [[{"k": 1}]]
    ShardStore(new, "uid", "0").append_wal(pa.table({"k": [3]}), 2, "batch-3")


def test_a_torn_or_missing_owner_record_refuses_writes(tmp_path: Path) -> None:
    plain = _data_dir(tmp_path)
    owned = plain.fenced(acquire(plain, "cluster-a", 10.0))
    (tmp_path / "data" / "owner.json").write_text(json.dumps({"owner": "cluster-a"})[:-3])
    with pytest.raises(OwnershipLostError):
        CatalogStore(owned).save(Catalog())
    (tmp_path / "data" / "owner.json").unlink()
    with pytest.raises(OwnershipLostError, match="no owner record"):
        CatalogStore(owned).save(Catalog())


def test_a_worker_refuses_a_data_directory_the_coordinator_did_not_lease(tmp_path: Path) -> None:
    """Each worker reads the lease the coordinator wrote: a node whose path to the data
    directory is its own disk (no lease there, or another cluster's) is refused clearly."""
    from shardflow.errors import ConfigError
    from shardflow.runtime.worker.local import check_shared

    shared = DataDir.resolve(str(tmp_path / "shared"))
    token = acquire(shared, "cluster-a", 10.0)
    check_shared(shared, token, "node-0")  # the coordinator's directory: fine
    local_disk = DataDir.resolve(str(tmp_path / "node-local"))  # same path, another disk
    with pytest.raises(ConfigError, match=r"cannot reach the data directory.*no lease"):
        check_shared(local_disk, token, "node-1")
    acquire(local_disk, "cluster-b", 10.0)
    with pytest.raises(ConfigError, match="another cluster"):
        check_shared(local_disk, token, "node-1")
