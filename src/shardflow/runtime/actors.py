"""The Ray actors: thin wrappers that put :class:`WorkerNode` and :class:`CoordinatorState`
on the cluster. All logic lives in those classes; here only what Ray needs."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import ray
from prometheus_client import start_http_server

from shardflow.catalog import OwnerToken
from shardflow.config import Settings
from shardflow.control.migration import plan_from_json
from shardflow.runtime.controller import Controller
from shardflow.runtime.coordinator import CoordinatorState
from shardflow.runtime.worker import ShardKey, WorkerNode
from shardflow.storage.shard import Change
from shardflow.telemetry.metrics import registry_for

LOOPBACK = "127.0.0.1"
WORKER_CONCURRENCY = 16
COORDINATOR_CONCURRENCY = 16


@ray.remote
class CoordinatorActor:
    def __init__(
        self, data_dir: str, settings: Settings, prefix: str, owner: str, description: str
    ) -> None:
        self.state = CoordinatorState(data_dir, settings, owner, description)
        self.controller = Controller(self.state, prefix, settings)
        registry, self.controller.recorder = registry_for(self.controller.gauges)
        server, _ = start_http_server(settings.metrics_port, addr=LOOPBACK, registry=registry)
        self.metrics_port = int(server.server_port)
        self.controller.start()  # watch workers; finish or roll back moves a crash cut short

    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    def record_query(self, seconds: float, ok: bool) -> None:
        if self.controller.recorder is not None:
            self.controller.recorder.query(seconds, ok)

    def record_insert(self, rows: int) -> None:
        if self.controller.recorder is not None:
            self.controller.recorder.insert(rows)

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def owner_token(self) -> OwnerToken:
        """The token every durable write of this cluster carries."""
        return self.state.owner

    def release(self) -> None:
        """Stop the control loops and give the data directory up (before the actors stop)."""
        self.controller.stop()
        self.state.release_lease()

    # -- cluster operations -------------------------------------------------------------
    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_move(unit_id, to))

    def split(self, unit_id: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_split(unit_id))

    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_merge(first, second))

    def migrations(self) -> list[dict[str, Any]]:
        return self.controller.history()

    def drain(self, node: str, deadline_s: float) -> dict[str, Any]:
        return self.controller.drain(node, deadline_s)

    def reserve_node(self) -> str:
        return self.state.reserve_node()

    def node_joined(self, node: str) -> dict[str, Any]:
        return self.state.node_joined(node)

    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        return self.controller.rebalance(dry_run)

    def node_loads(self) -> dict[str, dict[str, float | None]]:
        """Per node: the busy fraction over the last observed window and the capacity that
        placement and the balancer use (relative to the median node)."""
        nodes = list(self.state.catalog.nodes)
        capacities = self.controller.capacities(nodes, self.controller.mix)
        return {
            n: {"utilization": self.controller.utilization.get(n), "capacity": capacities.get(n)}
            for n in nodes
        }

    def shard_loads(self) -> list[tuple[str, int, float]]:
        return [(t, u, load) for (t, u), load in self.controller.shard_load.items()]

    def failovers(self) -> list[dict[str, Any]]:
        return [vars(f) for f in self.controller.failovers]

    def stop(self) -> None:
        self.controller.stop()

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
        self,
        node_id: str,
        data_dir: str,
        settings: Settings,
        coordinator: str,
        namespace: str,
        slowdown: float = 1.0,
    ) -> None:
        # The worker asks the coordinator what it owns and rebuilds those shards from
        # durable storage before serving.
        self.coordinator = ray.get_actor(coordinator, namespace=namespace)
        catalog = ray.get(self.coordinator.catalog.remote())
        owner = ray.get(self.coordinator.owner_token.remote())
        gpus = ray.get_gpu_ids()
        self.node = WorkerNode(
            node_id,
            data_dir,
            settings,
            catalog,
            owner=owner,
            slowdown=slowdown,
            gpu_index=int(gpus[0]) if gpus else None,
        )

    def calibrate(self) -> dict[str, Any]:
        """Measure the device and tell the coordinator (called once the cluster is up, one
        worker at a time, so that workers do not slow each other down while measuring)."""
        profile = asdict(self.node.calibrate())
        ray.get(self.coordinator.report_profile.remote(self.node.node_id, profile))
        return profile

    def info(self) -> dict[str, Any]:
        return self.node.info()

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        return True

    def load_report(self) -> dict[str, Any]:
        return self.node.load_report()

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
        self, table: str, parts: Mapping[int, tuple[pa.Table, Any]], batch_id: str, epoch: int
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
        profile: bool,
        *parts: pa.Table,
    ) -> tuple[pa.Table, dict[str, Any]]:
        """Called with ``num_returns=2``: the result stays in the object store for whoever
        needs it (the client, or the workers of a later stage) while the caller learns what
        was measured. An input may come in several parts (the fragment results of an earlier
        stage); they are concatenated here."""
        inputs: dict[str, list[pa.Table]] = {}
        for name, part in zip(names, parts, strict=True):
            inputs.setdefault(name, []).append(part)
        tables = {name: concat_tables(chunks) for name, chunks in inputs.items()}
        return self.node.execute(sql, bindings, epoch, tables, profile)

    # -- live moves: source side ----------------------------------------------------------
    def export_begin(self, plan: Mapping[str, Any]) -> dict[ShardKey, tuple[int, Any]]:
        return self.node.export_begin(plan_from_json(plan))

    def export_chunk(self, move_id: str, key: ShardKey) -> pa.Table | None:
        return self.node.export_chunk(move_id, key)

    def export_changes(
        self, move_id: str, since: Mapping[ShardKey, int]
    ) -> dict[ShardKey, list[Change]]:
        return self.node.export_changes(move_id, since)

    def fence(self, move_id: str) -> tuple[dict[ShardKey, list[Change]], dict[str, list[int]]]:
        return self.node.fence(move_id)

    def abort_export(self, move_id: str) -> None:
        self.node.abort_export(move_id)

    def retire(self, move_id: str) -> None:
        self.node.retire(move_id)

    def drop_retired(self, move_id: str) -> bool:
        return self.node.drop_retired(move_id)

    def unit_bytes(self, units: list[int]) -> int:
        return self.node.unit_bytes(units)

    def memory_headroom(self) -> int:
        return self.node.memory_headroom()

    def export_sums(self, move_id: str) -> dict[str, list[int]]:
        return self.node.export_sums(move_id)

    def import_sums(self, move_id: str) -> dict[str, list[int]]:
        return self.node.import_sums(move_id)

    # -- live moves: target side ----------------------------------------------------------
    def pull_snapshot(
        self, plan: Mapping[str, Any], sources: Mapping[str, Any], bandwidth_bytes_s: float
    ) -> tuple[int, int]:
        """Copy the sources' snapshots into new shards here, chunk by chunk (the next chunk
        is on its way while this one is loaded), at most ``bandwidth_bytes_s`` (0: no cap);
        returns rows and bytes copied."""
        move = plan_from_json(plan)
        self.node.import_begin(move)
        rows = size = 0
        started = time.monotonic()
        for source in sources.values():
            for key, (lsn, applied) in ray.get(source.export_begin.remote(plan)).items():
                pending = source.export_chunk.remote(move.move_id, key)
                while True:
                    chunk = ray.get(pending)
                    if chunk is None:
                        break
                    pending = source.export_chunk.remote(move.move_id, key)
                    rows += self.node.import_rows(move.move_id, key, chunk)
                    size += chunk.nbytes
                    if bandwidth_bytes_s > 0:
                        ahead = size / bandwidth_bytes_s - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
                self.node.import_snapshot_done(move.move_id, key, lsn, applied)
        self.node.import_commit(move.move_id)
        return rows, size

    def catch_up(self, move_id: str, sources: Mapping[str, Any]) -> int:
        """Apply what the sources took in since the last pull; returns those rows."""
        since = self.node.import_since(move_id)
        changes = ray.get(
            [source.export_changes.remote(move_id, since) for source in sources.values()]
        )
        return sum(self.node.import_changes(move_id, found) for found in changes)

    def apply_final(
        self, move_id: str, changes: list[dict[ShardKey, list[Change]]]
    ) -> tuple[int, dict[str, list[int]]]:
        """The last changes, handed out by the fenced sources; returns the rows applied and
        the new shards' checksums."""
        rows = sum(self.node.import_changes(move_id, found) for found in changes)
        return rows, self.node.import_sums(move_id)

    def promote(self, move_id: str) -> None:
        if move_id in self.node.imports:
            self.node.promote(move_id)

    def abort_import(self, move_id: str) -> None:
        self.node.abort_import(move_id)


def concat_tables(parts: list[pa.Table]) -> pa.Table:
    if len(parts) == 1:
        return parts[0]
    return pa.concat_tables(parts, promote_options="permissive")
