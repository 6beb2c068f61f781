"""Catalog transitions and persistence, with plain data and a temporary directory."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardflow.catalog import Catalog, CatalogStore, DataDir, TableSpec, Unit
from shardflow.catalog.grants import PRIVILEGES, SHARED, granted, privileges_of, revoked
from shardflow.catalog.store import CATALOG_FAULT_VARIABLE

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _with_table(catalog: Catalog, name: str = "t") -> Catalog:
    catalog, group = catalog.with_new_group(pa.int64(), ["n0", "n1", "n0", "n1"])
    return catalog.with_table(
        TableSpec(name, uuid.uuid4().hex, SCHEMA, "distributed", "k", group, 10)
    )


def test_new_group_units_cover_all_buckets() -> None:
    catalog = _with_table(Catalog(n_buckets=256, nodes=("n0", "n1")))
    group = catalog.group_of("t")
    owners = group.owners_of(np.arange(256))
    assert sorted(set(owners.tolist())) == sorted(u.unit_id for u in group.units)
    assert all(
        u.lo <= b < u.hi for b, o in enumerate(owners) for u in group.units if u.unit_id == o
    )
    assert [u.node for u in group.units] == ["n0", "n1", "n0", "n1"]
    assert {str(r) for r in catalog.shards_on("n1")} == {"t#1", "t#3"}


def test_every_change_bumps_version_and_ownership_changes_bump_epoch() -> None:
    catalog = _with_table(Catalog(nodes=("n0", "n1")))
    version, epoch = catalog.version, catalog.epoch
    orphans = catalog.orphaned_units(["n0"])
    assert [u.unit_id for u in orphans] == [1, 3]
    moved = catalog.with_nodes(["n0"], {1: "n0", 3: "n0"})
    assert moved.version == version + 1 and moved.epoch == epoch + 1
    assert {u.node for u in moved.group_of("t").units} == {"n0"}
    same = moved.with_nodes(["n0"], {})
    assert same.epoch == moved.epoch


def test_dropping_last_table_of_group_drops_the_group() -> None:
    catalog = _with_table(Catalog(nodes=("n0", "n1")))
    group = catalog.table("t").group
    other = catalog.with_table(TableSpec("u", "uid2", SCHEMA, "distributed", "k", group))
    assert group in other.without_table("t").groups
    assert group not in catalog.without_table("t").groups


def test_json_round_trip() -> None:
    catalog = _with_table(Catalog(nodes=("n0", "n1")))
    catalog = catalog.with_table(TableSpec("r", "uid3", SCHEMA, "replicated"))
    group = catalog.table("t").group
    catalog = catalog.with_table(TableSpec("k", "uid4", SCHEMA, "distributed", "k", group, 0, True))
    restored = Catalog.from_json(json.loads(json.dumps(catalog.to_json())))
    assert restored.to_json() == catalog.to_json()
    assert restored.table("t").schema.equals(SCHEMA)
    assert restored.table("k").key_index and not restored.table("t").key_index
    older = catalog.to_json()  # a catalog written before tables had key indexes
    for spec in older["tables"]:
        spec.pop("key_index")
    assert not any(t.key_index for t in Catalog.from_json(older).tables.values())


def test_the_store_writes_changes_and_now_and_then_a_snapshot(tmp_path: Path) -> None:
    """Each save writes the change from the version before (a move: a few hundred bytes,
    however many tables there are); every third change here a snapshot, and only the two
    newest snapshots and the changes after the older stay. Another store loads the same
    catalog; one that loaded before reads on from where it was."""
    store = CatalogStore(DataDir.resolve(str(tmp_path)), snapshot_every=3, background=False)
    # (here a snapshot also follows whenever the changes since weigh more than it)
    reader = CatalogStore(DataDir.resolve(str(tmp_path)))
    assert store.load() is None
    catalog = Catalog(nodes=("n0", "n1"))
    for name in ("a", "b", "c", "d", "e", "f", "g"):
        catalog = _with_table(catalog, name)
        store.save(catalog)
    assert reader.load() == catalog
    before = store.written
    group = catalog.table("g").group
    unit = catalog.groups[group].units[0]
    moved = catalog.with_units_replaced(group, [unit.unit_id], [Unit(99, unit.lo, unit.hi, "n1")])
    store.save(moved)
    assert store.written - before < 300  # the units it replaced and the epoch
    names = sorted(p.name for p in (tmp_path / "catalog").iterdir())
    snapshots = [int(n[9:21]) for n in names if n.startswith("snapshot-")]
    changes = [int(n[6:18]) for n in names if n.startswith("delta-")]
    assert len(snapshots) == 2 and snapshots[-1] > 2  # the first (version 2) is gone
    saved = [*range(4, 15, 2), 15]  # each table two versions on, then the move
    assert changes == [v for v in saved if v > snapshots[0]]
    assert reader.load() == moved  # on from version 14
    assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == moved
    # the newest snapshot cut short: the older one and the changes after it
    (tmp_path / "catalog" / "snapshot-000000000015.json").write_text('{"vers')
    assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == moved


def test_a_change_written_ahead_is_committed_only_where_it_is_the_change_made(
    tmp_path: Path,
) -> None:
    """A move's switch writes its change ahead (synced, under a name no load reads) and
    commits it by a rename, but only where it is, byte for byte, the change the commit
    makes: one prepared for a version another change took first, or for another catalog
    of that version, is discarded and the change written whole. A new owner removes what
    an owner before it prepared."""
    folder = tmp_path / "catalog"
    store = CatalogStore(DataDir.resolve(str(tmp_path)), background=False)
    base = _with_table(Catalog(nodes=("n0", "n1")))
    store.save(base)
    group = base.table("t").group
    unit = base.groups[group].units[0]

    def moved(catalog: Catalog, to: str) -> Catalog:  # the first unit, to node ``to``
        [now] = [u for u in catalog.groups[group].units if u.lo == unit.lo]
        return catalog.with_units_replaced(
            group, [now.unit_id], [Unit(now.unit_id + 100, unit.lo, unit.hi, to)]
        )

    prepared = store.prepare(moved(base, "n1"))
    assert prepared is not None and (folder / Path(prepared.path).name).exists()
    assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == base  # not read yet
    store.save(moved(base, "n1"), prepared)
    assert not list(folder.glob("*.prepared"))  # renamed into its place
    assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == moved(base, "n1")

    now = moved(base, "n1")
    for other in ("table", "move"):  # a version on came first; another change of it
        ahead = store.prepare(moved(now, "n0"))
        first = _with_table(now, "late") if other == "table" else moved(now, "n1")
        assert ahead is not None
        store.save(first, ahead)
        assert not list(folder.glob("*.prepared"))  # discarded
        assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == first, first.version
        now = first

    left = store.prepare(_with_table(now, "never"))  # its owner stopped before the commit
    assert left is not None and list(folder.glob("*.prepared"))
    CatalogStore(DataDir.resolve(str(tmp_path))).discard_all_prepared()
    assert not list(folder.glob("*.prepared"))


def test_a_catalog_kept_whole_by_an_older_store_is_read(tmp_path: Path) -> None:
    """Data directories written before the change log hold whole versions
    (``<version>.json``): they are snapshots, the changes go on from the newest."""
    catalog = _with_table(Catalog(nodes=("n0",)))
    folder = tmp_path / "catalog"
    folder.mkdir()
    (folder / f"{catalog.version:012d}.json").write_text(json.dumps(catalog.to_json()))
    store = CatalogStore(DataDir.resolve(str(tmp_path)))
    assert store.load() == catalog
    newer = _with_table(catalog, "u")
    store.save(newer)
    assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == newer


CRASHING_SAVE = """
import sys, uuid
import pyarrow as pa
from shardflow.catalog import Catalog, CatalogStore, DataDir, TableSpec
store = CatalogStore(DataDir.resolve(sys.argv[1]))
catalog = store.load()
catalog, group = catalog.with_new_group(pa.int64(), ["n0", "n1"])
schema = pa.schema([("k", pa.int64())])
store.save(catalog.with_table(TableSpec("late", "uid-late", schema, "distributed", "k", group)))
"""


def test_a_crash_in_the_middle_of_writing_a_change_leaves_the_version_before(
    tmp_path: Path,
) -> None:
    """A process killed (SIGKILL) while it writes a change, half of it on disk where it
    lies (a filesystem without atomic puts; the fault hook): the load passes over it to
    the version before, whole, and the next owner's changes follow on from that one."""
    store = CatalogStore(DataDir.resolve(str(tmp_path)))
    catalog = Catalog(nodes=("n0", "n1"))
    for name in ("a", "b"):
        catalog = _with_table(catalog, name)
        store.save(catalog)
    env = {**os.environ, CATALOG_FAULT_VARIABLE: "torn-delta"}
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(tmp_path)], env=env, capture_output=True
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()
    torn = tmp_path / "catalog" / f"delta-{catalog.version + 2:012d}.json"
    assert torn.exists() and not _parses(torn)
    again = CatalogStore(DataDir.resolve(str(tmp_path)))
    assert again.load() == catalog
    # the next owner's save is three steps on: the torn change stays, passed over
    following = _with_table(catalog.with_node_added("n2"), "c")
    assert following.version > catalog.version + 2
    again.save(following)
    assert torn.exists()
    assert CatalogStore(DataDir.resolve(str(tmp_path))).load() == following
    # without the fault the same save goes through
    clean = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(tmp_path)], capture_output=True
    )
    assert clean.returncode == 0, clean.stderr.decode()
    assert "late" in CatalogStore(DataDir.resolve(str(tmp_path))).load().tables


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except ValueError:
        return False
    return True


def test_data_dir_accepts_file_uris(tmp_path: Path) -> None:
    data_dir = DataDir.resolve(f"file://{tmp_path}/nested")
    data_dir.write_atomic(data_dir.path("x.bin"), b"abc")
    assert data_dir.read(data_dir.path("x.bin")) == b"abc"
    assert (tmp_path / "nested" / "x.bin").read_bytes() == b"abc"


def test_a_cluster_that_starts_again_keeps_its_node_ids() -> None:
    """The nodes a data directory last had come first (their units stay where they are);
    more nodes get ids never used before, fewer keep the lowest (the rest's units are
    placed again)."""
    import doctest

    from shardflow.catalog import model

    assert doctest.testmod(model).failed == 0
    catalog = Catalog(nodes=("node-0", "node-3", "node-5"), next_node_index=7)
    assert catalog.node_ids(3) == ["node-0", "node-3", "node-5"]
    assert catalog.node_ids(5) == ["node-0", "node-3", "node-5", "node-7", "node-8"]
    assert catalog.node_ids(2) == ["node-0", "node-3"]


def test_a_tables_grants_travel_with_it_and_old_catalogs_read_as_shared() -> None:
    catalog = _with_table(Catalog(n_buckets=256, nodes=("n0", "n1")))
    spec = catalog.table("t")
    assert spec.grants == SHARED  # made through the Python API: every account, by role
    owned = dataclasses.replace(spec, grants=(("bob", "OWNER", "2026-01-01"),))
    changed = catalog.with_table(owned)
    assert Catalog.from_json(changed.to_json()).table("t").grants == owned.grants
    old = changed.to_json()
    for table in old["tables"]:
        del table["grants"]  # a catalog written before grants existed
    assert Catalog.from_json(old).table("t").grants == SHARED
    assert granted((), "alice", ["SELECT"], "s1") == (("alice", "SELECT", "s1"),)
    assert revoked((("alice", "SELECT", "s1"), ("bob", "SELECT", "")), "alice", ["SELECT"]) == (
        ("bob", "SELECT", ""),
    )
    assert privileges_of(["all privileges"]) == PRIVILEGES
    with pytest.raises(ValueError, match="unknown privilege 'DROP'"):
        privileges_of(["DROP"])
