"""Catalog transitions and persistence, with plain data and a temporary directory."""

import json
import uuid
from pathlib import Path

import pyarrow as pa

from shardflow.catalog import Catalog, CatalogStore, DataDir, TableSpec
from shardflow.catalog.store import KEEP_VERSIONS

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _with_table(catalog: Catalog, name: str = "t") -> Catalog:
    catalog, group = catalog.with_new_group(pa.int64(), ["n0", "n1", "n0", "n1"])
    return catalog.with_table(
        TableSpec(name, uuid.uuid4().hex, SCHEMA, "distributed", "k", group, 10)
    )


def test_new_group_units_cover_all_buckets() -> None:
    catalog = _with_table(Catalog(n_buckets=256, nodes=("n0", "n1")))
    group = catalog.group_of("t")
    owners = group.bucket_owners(256)
    assert -1 not in owners
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


def test_store_keeps_recent_versions_and_survives_a_torn_write(tmp_path: Path) -> None:
    store = CatalogStore(DataDir.resolve(str(tmp_path)))
    assert store.load() is None
    catalog = Catalog(nodes=("n0",))
    for _ in range(KEEP_VERSIONS + 3):
        catalog = _with_table(catalog, f"t{catalog.version}")
        store.save(catalog)
    files = sorted((tmp_path / "catalog").iterdir())
    assert len(files) == KEEP_VERSIONS
    latest = store.load()
    assert latest is not None and latest.version == catalog.version
    # A newer version that was never fully written: the reader falls back to the last good one.
    (tmp_path / "catalog" / f"{catalog.version + 1:012d}.json").write_text('{"vers')
    recovered = store.load()
    assert recovered is not None and recovered.version == catalog.version


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
