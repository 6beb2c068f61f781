"""The Ray head of a cluster started with ``shardflow cluster up --ha`` is SIGKILLed (its
whole process tree) under an inserter and two checked readers: its keeper starts it again
at the same address, its state comes back from Redis, the workers and the coordinator serve
meanwhile, and no client operation fails. A node that joins afterwards proves the new head
runs the cluster (Ray's GCS answers again).

With its protection off (``SHARDFLOW_TEST_HEAD_FORGETS=1``: the head starts again without its
Redis, as a head without fault tolerance would) this test fails: the data nodes cannot join
the new head's cluster and die, and the clients' operations fail."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray._common.utils import get_default_ray_temp_dir

from shardflow.flightsql import wire as fsql
from shardflow.runtime.ray.local import _folder_beside_head
from shardflow.tools.localcluster import LocalRayCluster
from tests.cluster.test_multinode import SHARDFLOW, run, run_drill

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def ha_cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[Path]:
    data_dir = tmp_path_factory.mktemp("ha") / "data"
    out = run(*SHARDFLOW, "cluster", "up", "--ha", "--nodes", "2", "--data-dir", str(data_dir),
              "--object-store-mb", "128")  # fmt: skip
    assert "survives" in out, out
    try:
        yield data_dir
    finally:
        run(*SHARDFLOW, "cluster", "down", "--data-dir", str(data_dir), timeout=120)
    assert not (data_dir / "local-cluster" / "redis.password").exists()


def test_the_head_is_killed_under_load_and_nothing_fails(ha_cluster: Path) -> None:
    local = LocalRayCluster(ha_cluster)
    ha = local.ha
    assert ha is not None and ha.redis.startswith("127.0.0.1:") and ha.redis_pid
    head_before = local.head_process()
    assert head_before is not None
    # drivers of this machine join through the data nodes' folder, never on the head
    assert _folder_beside_head(local.address) == get_default_ray_temp_dir()
    report, _, off_loopback = run_drill(
        local,
        "--rows",
        "5000",
        "--moves",
        "4",
        "--kill",
        "head",
        "--rejoin",
        "ray-7",
        watch=(ha.redis_pid,),  # Redis and the restarted head too: loopback only
    )
    assert report["failures"] == [] and report["failed_ops"] == 0, report["failures"]
    assert report["wrong_answers"] == 0
    assert report["lost_rows"] == 0 and report["duplicated_rows"] == 0
    assert report["lost"] == ["head"] and len(report["recovery_s"]) == 1
    assert report["queries"] > 0 and report["inserts"] > 0
    assert len(report["joined"]) == 1  # a worker started on a node that joined the new head
    head_after = local.head_process()
    assert head_after is not None and head_after[0] != head_before[0]
    assert off_loopback == []
    status = run(*SHARDFLOW, "cluster", "status", "--data-dir", str(ha_cluster))
    assert "head: survives its loss" in status and "health: ok" in status, status
    assert "ray-7" in status


def test_a_seeded_nemesis_kills_pauses_and_loses_the_head_and_nothing_fails(
    ha_cluster: Path,
) -> None:
    """A short seeded schedule (the same every run): every fault kind of the nemesis, and
    its last line says nothing failed, was lost, doubled or read stale."""
    local = LocalRayCluster(ha_cluster)
    report, out, off_loopback = run_drill(
        local, "--rows", "5000", "--moves", "0", "--nemesis", "kill,pause,head",
        "--faults", "3", "--seed", "6",
    )  # fmt: skip
    assert sorted(f.split()[0] for f in report["faults"]) == ["head", "kill", "pause"]
    last = out.splitlines()[-1]
    assert last.startswith("faults=3 failed_ops=0 lost=0 dup=0 stale_reads=0 "), out[-2000:]
    assert report["failures"] == [] and report["wrong_answers"] == 0
    assert max(report["fault_recovery_s"]) < 120 and off_loopback == []
    assert len(report["joined"]) == 1  # a node joined after the killed one


def test_the_head_of_a_cluster_without_ha_is_not_killed_by_accident(ha_cluster: Path) -> None:
    """``remove-node head --kill`` is for a head that comes back; a head without Redis is
    refused with the way to stop the cluster instead (checked on a cluster record)."""
    plain = LocalRayCluster(ha_cluster.parent / "plain")
    plain.folder.mkdir(parents=True)
    state = json.loads(LocalRayCluster(ha_cluster).state_file.read_text())
    state.pop("ha")
    plain.state_file.write_text(json.dumps(state))
    with pytest.raises(Exception, match="without --ha"):
        plain.kill_head()


def test_ha_without_a_redis_says_what_to_install(tmp_path: Path) -> None:
    """No redis-server on the PATH: a clear error, and nothing is left running."""
    environment = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    done = subprocess.run(
        [*SHARDFLOW, "cluster", "up", "--ha", "--data-dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=120, env=environment,
    )  # fmt: skip
    assert done.returncode != 0
    assert "apt-get install redis-server" in done.stderr + done.stdout
    assert not LocalRayCluster(tmp_path / "d").running
    done = subprocess.run(
        [*SHARDFLOW, "cluster", "up", "--redis", "no-port", "--data-dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "HOST:PORT" in done.stderr + done.stdout


def test_two_doors_a_client_goes_on_when_its_door_dies(ha_cluster: Path) -> None:
    """Two Flight SQL replicas (``shardflow serve --address``) serve the cluster; a client
    given both addresses inserts and queries while the replica it uses is SIGKILLed: no
    operation fails, every acknowledged row is there once, and a bearer token one replica
    issued is taken by the other."""
    import pyarrow as pa
    import pyarrow.flight as flight

    import shardflow
    from tests.service.conftest import PASSWORDS, add_users, start_service

    local = LocalRayCluster(ha_cluster)
    add_users(ha_cluster)
    doors = [start_service(ha_cluster, "--address", local.address, workers=None) for _ in "ab"]
    try:
        one = flight.FlightClient(doors[0].uri)
        header = one.authenticate_basic_token("alice", PASSWORDS["alice"])
        catalogs = flight.FlightDescriptor.for_command(
            fsql.pack(fsql.new("CommandGetCatalogs"))
        )  # the token of one door, at the other
        flight.FlightClient(doors[1].uri).get_flight_info(
            catalogs, flight.FlightCallOptions(headers=[header])
        )
        one.close()
        with shardflow.connect(
            f"{doors[0].uri},{doors[1].uri}", user="olga", password=PASSWORDS["olga"]
        ) as db:
            db.create_table("doors", pa.table({"id": pa.array([], pa.int64())}),
                            distributed_by="id")  # fmt: skip
            acked: list[int] = []
            for step in range(40):
                if step == 15:
                    doors[0].process.kill()  # the door in use dies
                    doors[0].process.wait()
                ids = list(range(step * 10, step * 10 + 10))
                db.insert("doors", pa.table({"id": pa.array(ids, pa.int64())}))
                acked += ids
                count = db.sql("SELECT count(*) AS n FROM doors").to_pylist()
                assert count == [{"n": len(acked)}]
            assert db.addresses[db._at] == doors[1].uri  # it went on at the other door
            got = db.sql("SELECT id FROM doors ORDER BY id").column("id").to_pylist()
            assert got == acked
            db.drop_table("doors")
    finally:
        for door in doors:
            door.stop()
