"""The Ray actors: thin wrappers that put :class:`WorkerNode` and :class:`CoordinatorState`
on the cluster. All logic lives in those classes; here only what Ray needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import ray

from shardflow.config import Settings
from shardflow.runtime.coordinator import CoordinatorState
from shardflow.runtime.worker import WorkerNode

WORKER_CONCURRENCY = 16
COORDINATOR_CONCURRENCY = 8


@ray.remote
class CoordinatorActor:
    def __init__(self, data_dir: str, settings: Settings) -> None:
        self.state = CoordinatorState(data_dir, settings)

    def catalog(self) -> dict[str, Any]:
        return self.state.catalog_json()

    def register_nodes(self, nodes: list[str]) -> dict[str, Any]:
        return self.state.register_nodes(nodes)

    def report_profile(self, node_id: str, profile: dict[str, Any]) -> None:
        self.state.report_profile(node_id, profile)

    def begin_create(
        self, name: str, schema: bytes, kind: str, key: str | None, colocate_with: str | None
    ) -> dict[str, Any]:
        return self.state.begin_create(name, schema, kind, key, colocate_with)

    def commit_create(self, name: str, rows: int) -> dict[str, Any]:
        return self.state.commit_create(name, rows)

    def abort_create(self, name: str) -> None:
        self.state.abort_create(name)

    def drop_table(self, name: str) -> tuple[dict[str, Any], str]:
        return self.state.drop_table(name)

    def delete_files(self, uid: str) -> None:
        self.state.delete_files(uid)

    def profiles(self) -> dict[str, dict[str, Any]]:
        return dict(self.state.profiles)


@ray.remote
class WorkerActor:
    def __init__(
        self, node_id: str, data_dir: str, settings: Settings, coordinator: str, namespace: str
    ) -> None:
        # On a restart after a crash this runs again: the worker asks the coordinator what it
        # owns and rebuilds those shards from durable storage before serving.
        handle = ray.get_actor(coordinator, namespace=namespace)
        catalog = ray.get(handle.catalog.remote())
        self.node = WorkerNode(node_id, data_dir, settings, catalog)
        handle.report_profile.remote(node_id, self.node.info()["profile"])

    def info(self) -> dict[str, Any]:
        return self.node.info()

    def pid(self) -> int:
        import os

        return os.getpid()

    def sync(self, catalog: Mapping[str, Any]) -> int:
        return self.node.sync(catalog)

    def prepare(self, spec: Mapping[str, Any], unit_ids: list[int], primary: bool) -> None:
        self.node.prepare(spec, unit_ids, primary)

    def stage(self, table: str, keys: list[int | str], *parts: pa.Table) -> int:
        # parts travel as top-level arguments so that Ray resolves object references
        return self.node.stage(table, dict(zip(keys, parts, strict=True)))

    def commit_load(self, table: str) -> int:
        return self.node.commit_load(table)

    def finish_load(self, table: str, catalog: Mapping[str, Any]) -> None:
        self.node.finish_load(table, catalog)

    def abort_load(self, table: str) -> None:
        self.node.abort_load(table)

    def append(
        self, table: str, parts: Mapping[int, pa.Table], batch_id: str, epoch: int
    ) -> dict[int, int]:
        return self.node.append(table, parts, batch_id, epoch)

    def append_replica(self, table: str, part: pa.Table, batch_id: str) -> int:
        return self.node.append_replica(table, part, batch_id)

    def drop(self, table: str) -> None:
        self.node.drop(table)

    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        names: list[str],
        *parts: pa.Table,
    ) -> tuple[pa.Table, tuple[float, int]]:
        """Called with ``num_returns=2``: the result stays in the object store for whoever
        needs it (the client, or the workers of a later stage) while the caller learns the
        execution time and row count. An input may come in several parts (the fragment
        results of an earlier stage); they are concatenated here."""
        inputs: dict[str, list[pa.Table]] = {}
        for name, part in zip(names, parts, strict=True):
            inputs.setdefault(name, []).append(part)
        tables = {name: concat_tables(chunks) for name, chunks in inputs.items()}
        result, seconds = self.node.execute(sql, bindings, epoch, tables)
        return result, (seconds, result.num_rows)


def concat_tables(parts: list[pa.Table]) -> pa.Table:
    if len(parts) == 1:
        return parts[0]
    return pa.concat_tables(parts, promote_options="permissive")
