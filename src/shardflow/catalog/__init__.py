"""Metadata: tables, co-location groups, placement units, routing epochs, persisted store."""

from shardflow.catalog.model import (
    ROUND_ROBIN,
    Catalog,
    Group,
    ShardRef,
    TableKind,
    TableSpec,
    Unit,
)
from shardflow.catalog.names import find_name, name_key
from shardflow.catalog.store import CatalogStore, DataDir, OwnerToken, recorded_catalog

__all__ = [
    "ROUND_ROBIN",
    "Catalog",
    "CatalogStore",
    "DataDir",
    "Group",
    "OwnerToken",
    "ShardRef",
    "TableKind",
    "TableSpec",
    "Unit",
    "find_name",
    "name_key",
    "recorded_catalog",
]
