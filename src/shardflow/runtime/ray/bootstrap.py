"""Bringing a cluster up on Ray and down again: the coordinator and worker actors of one data
directory, on an embedded local Ray or on a Ray cluster joined by address, with the handles
they are given to reach each other; and the service operations of the command line (attach,
stop, drain a Ray node)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from shardflow.catalog import DataDir, OwnerToken, lease, recorded_catalog
from shardflow.config import Settings
from shardflow.errors import ConfigError, DataDirInUseError, Error, WorkerGone
from shardflow.runtime.protocol import CatalogJson, Reply, admit_workers
from shardflow.runtime.ray.actors import CoordinatorActor, WorkerActor
from shardflow.runtime.ray.handles import RayCoordinator, RayWorker, RayWorkers
from shardflow.runtime.ray.local import release_ray, start_ray
from shardflow.runtime.ray.membership import check_storage_on
from shardflow.runtime.ray.names import (
    COORDINATOR_CONCURRENCY,
    DATA_NODE_RESOURCE,
    NAMESPACE,
    WORKER_CONCURRENCY,
    coordinator_actor_name,
    worker_actor_name,
)
from shardflow.runtime.ray.slots import Slot, choose_slots, slot_options, worker_slots
from shardflow.runtime.worker.local import local_root, machine_share

log = logging.getLogger(__name__)
_embedded: dict[str, ClusterHandle] = {}
"""The embedded cluster serving each data directory in this process (one owner per data
directory: a second ``connect`` to it shares these actors)."""
_embedded_users: Counter[str] = Counter()
"""Open databases per embedded cluster (by prefix); its actors stop with the last one."""
RELEASE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Spawner:
    """Starts the worker actors of one cluster. The coordinator of a cluster joined by
    address gets one, to start workers on Ray nodes that join; it travels there by value."""

    prefix: str
    data_dir: str
    settings: Settings
    """The workers' settings."""
    detached: bool
    """Workers outlive the process that started them (a cluster joined by address)."""

    def spawn(self, node: str, slot: Slot, slowdown: float = 1.0) -> RayWorker:
        """Create the worker actor of ``node`` on ``slot``; it loads what the catalog
        assigns it. A ``slowdown`` above 1 makes it a simulated slower device (tests and
        demos)."""
        actor = WorkerActor.options(
            name=worker_actor_name(self.prefix, node),
            namespace=NAMESPACE,
            max_restarts=0,  # a dead worker stays dead: the coordinator reassigns its shards
            max_concurrency=WORKER_CONCURRENCY,
            **slot_options(slot, self.detached),
        ).remote(
            node,
            self.data_dir,
            self.settings,
            RayCoordinator(self.prefix),
            RayWorkers(self.prefix, fast_lane=self.settings.fast_lane),
            slowdown,
        )
        return RayWorker(node, actor)


@dataclass
class ClusterHandle:
    """The actors a session talks to, and what ``close`` must undo."""

    prefix: str
    data_dir: str
    settings: Settings
    coordinator: RayCoordinator
    workers: RayWorkers
    spawner: Spawner
    started_ray: bool = False
    owns_actors: bool = True
    slots: dict[str, Slot] = field(default_factory=dict)
    """Where each worker this process started runs."""


def launch(
    address: str | None,
    workers: int | None,
    data_dir: str,
    settings: Settings,
    simulate: Mapping[str, float] | None = None,
) -> ClusterHandle:
    """Start (or attach to) the coordinator and the workers."""
    if address is None:  # workers on this machine: a bad local_dir is said before any starts
        local_root(settings.local_dir)
    started = start_ray(address, settings)
    try:
        return _launch_actors(address, workers, data_dir, settings, started, simulate or {})
    except BaseException:
        if started:
            release_ray()
        raise


def _handle(
    prefix: str, data_dir: str, settings: Settings, detached: bool, started: bool
) -> ClusterHandle:
    spawner = Spawner(prefix, data_dir, settings, detached)
    return ClusterHandle(
        prefix, data_dir, settings, RayCoordinator(prefix), RayWorkers(prefix), spawner, started
    )


def _launch_actors(
    address: str | None,
    workers: int | None,
    data_dir: str,
    settings: Settings,
    started: bool,
    simulate: Mapping[str, float],
) -> ClusterHandle:
    embedded = address is None
    if embedded:
        serving = _embedded.get(data_dir)
        if serving is not None:  # this process serves the data directory already: share it
            _embedded_users[serving.prefix] += 1
            return dataclasses.replace(serving, started_ray=started, owns_actors=False)
        prefix = f"local-{uuid.uuid4().hex[:8]}"  # several embedded databases never collide
    else:  # sessions on one Ray cluster and one data directory share the actors
        prefix = service_prefix(data_dir)
    handle = _handle(prefix, data_dir, settings, not embedded, started)
    try:  # a cluster for this data directory already runs: attach to it
        ray.get_actor(coordinator_actor_name(prefix), namespace=NAMESPACE)
        return dataclasses.replace(handle, owns_actors=False)
    except ValueError:
        pass
    _refuse_if_owned(data_dir)
    recorded = recorded_catalog(data_dir)
    offered = worker_slots(ray.nodes())  # type: ignore[no-untyped-call]
    if embedded and workers is None and recorded.nodes and not any(s.gpu for s in offered):
        workers = len(recorded.nodes)  # the cluster the data directory last had
    slots = choose_slots(offered, workers, embedded)
    if not slots:
        raise ConfigError(f"the Ray cluster at {address} has no node to run workers on")
    if embedded:  # its workers share this machine's cores and memory
        settings = machine_share(settings, len(slots))
    handle.spawner = Spawner(prefix, data_dir, settings, not embedded)
    owner = f"{prefix}-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {"lifetime": "detached"} if not embedded else {}
    # the handle is kept: an embedded actor lives as long as a handle to it does
    actor = CoordinatorActor.options(
        name=coordinator_actor_name(prefix),
        namespace=NAMESPACE,
        max_restarts=-1,
        max_concurrency=COORDINATOR_CONCURRENCY,
        num_cpus=0,
        **options,
        **_data_node_share(slots),
    ).remote(
        data_dir,
        handle.settings,
        owner,
        _describe(address),
        RayWorkers(prefix, fast_lane=handle.settings.fast_lane),  # a retire over the lanes
        None if embedded else handle.spawner,
    )
    handle.coordinator = RayCoordinator(prefix, actor)
    nodes = recorded.node_ids(len(slots))  # its nodes keep their units where they are
    try:
        if embedded:
            # The workers start while the coordinator does: on a small machine start-up is
            # mostly processes starting. One that read the catalog before the nodes were
            # registered catches up when admitted.
            registered = handle.coordinator.register_nodes(nodes)
            _start_workers(handle, nodes, slots, simulate)
            catalog = _coordinator_answer(registered, data_dir)
        else:
            _coordinator_answer(handle.coordinator.ping(), data_dir)
            owner_token = handle.coordinator.owner_token().get()
            _check_coordinator_storage(handle, owner_token)
            check_storage_on(slots, data_dir, owner_token)
            catalog = handle.coordinator.register_nodes(nodes).get()
            _start_workers(handle, nodes, slots, simulate)
        admit_workers([handle.workers.get(node) for node in nodes], None, catalog)
    except BaseException:
        _stop_actors(handle)  # nothing half-started stays behind
        raise
    if embedded:
        _embedded[data_dir] = handle
        _embedded_users[prefix] = 1
    else:
        handle.coordinator.start_joining().get()
    return handle


def _start_workers(
    handle: ClusterHandle, nodes: list[str], slots: list[Slot], simulate: Mapping[str, float]
) -> None:
    for node, slot in zip(nodes, slots, strict=True):
        start_worker(handle, node, slot, simulate.get(node, 1.0))


def _coordinator_answer(reply: Reply[CatalogJson] | Reply[int], data_dir: str) -> Any:
    """The new coordinator's first answer; it is gone when another cluster took the data
    directory's lease meanwhile (said so)."""
    try:
        return reply.get()
    except WorkerGone:
        _refuse_if_owned(data_dir)
        raise


def _check_coordinator_storage(handle: ClusterHandle, owner: OwnerToken) -> None:
    """The coordinator took the lease in the data directory this process sees: otherwise it
    runs on a node whose own disk holds that path."""
    record = lease.read_lease(DataDir.resolve(handle.data_dir))
    if record is not None and record.owner == owner.owner:
        return
    host = handle.coordinator.host().get()
    names = {s.ray_node_id: s.name for s in worker_slots(ray.nodes())}  # type: ignore[no-untyped-call]
    raise ConfigError(
        f"the coordinator's Ray node {names.get(host, host)} cannot reach the data directory "
        f"{handle.data_dir!r} this process uses (it wrote its lease elsewhere). A cluster of "
        "several machines needs a data directory on storage every node reaches (a shared "
        "path or a filesystem URI)."
    )


def _data_node_share(slots: list[Slot]) -> dict[str, Any]:
    """Keep the coordinator on nodes that serve data where some are marked for it: a head
    node started for control alone may be one whose loss ends the Ray cluster anyway."""
    marked = ray.cluster_resources().get(DATA_NODE_RESOURCE)  # type: ignore[no-untyped-call]
    if any(s.ray_node_id for s in slots) and marked:
        return {"resources": {DATA_NODE_RESOURCE: 0.001}}
    return {}


def request_ray_drain(ray_node_id: str, deadline_s: float) -> None:
    """Ask Ray to drain a node, as its autoscaler does before it takes a machine away
    (preemption: running actors do not refuse it); a coordinator with ``auto_join`` then
    drains the shardflow workers there. Needs this process connected to the cluster."""
    from ray.core.generated import autoscaler_pb2

    client = ray._raylet.GcsClient(  # type: ignore[attr-defined]
        address=ray.get_runtime_context().gcs_address
    )
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, why = client.drain_node(
        ray_node_id,
        autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
            "DRAIN_NODE_REASON_PREEMPTION"
        ),
        "shardflow cluster remove-node",
        deadline_ms,
    )
    if not accepted:
        raise ConfigError(f"Ray refused to drain node {ray_node_id}: {why}")


def service_prefix(data_dir: str) -> str:
    """The actor name prefix of the cluster serving ``data_dir`` on a Ray cluster."""
    return f"db-{uuid.uuid5(uuid.NAMESPACE_URL, data_dir).hex[:12]}"


def require_service(address: str, data_dir: str) -> None:
    """Join the Ray cluster at ``address`` and make sure a shardflow service serves
    ``data_dir`` there (so that a later ``connect`` attaches to it rather than starting
    one). Raises ``ConfigError`` when none does."""
    start_ray(address, Settings())
    try:
        ray.get_actor(coordinator_actor_name(service_prefix(data_dir)), namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(
            f"no shardflow service serves {data_dir} at {address} (start one with "
            "`shardflow serve` or `shardflow cluster up`)"
        ) from None


def stop_service(address: str, data_dir: str) -> list[str]:
    """Stop the coordinator and every worker serving ``data_dir`` on the Ray cluster at
    ``address`` (started by ``shardflow serve`` or another process); returns the nodes
    stopped. Raises ``ConfigError`` when none serves it."""
    joined = not ray.is_initialized()
    started = start_ray(address, Settings())
    try:
        prefix = service_prefix(data_dir)
        try:
            ray.get_actor(coordinator_actor_name(prefix), namespace=NAMESPACE)
        except ValueError:
            raise ConfigError(f"no shardflow service serves {data_dir} at {address}") from None
        handle = _handle(prefix, data_dir, Settings(), True, False)
        try:
            catalog = handle.coordinator.catalog().get(RELEASE_TIMEOUT_S)
            count = int(catalog.get("next_node_index", 0))
        except Error:
            count = 0
        nodes = [f"node-{i}" for i in range(count)]  # every worker it ever started
        _stop_actors(handle, nodes)
        return nodes
    finally:
        if started:
            release_ray()
        elif joined:
            ray.shutdown()


def _refuse_if_owned(data_dir: str) -> None:
    """Say so, before anything starts, when another live cluster owns ``data_dir``."""
    directory = DataDir.resolve(data_dir)
    record = lease.read_lease(directory)
    now = time.time()
    if record is not None and not lease.vacant(record, owner="", now=now):
        raise DataDirInUseError(lease.in_use_message(directory, record, now))


def _describe(address: str | None) -> str:
    if address is None:
        return lease.this_process("embedded cluster")
    return f"on the Ray cluster at {address}"


def start_worker(handle: ClusterHandle, node: str, slot: Slot, slowdown: float = 1.0) -> RayWorker:
    """Start the worker actor of ``node`` on ``slot`` (see :meth:`Spawner.spawn`)."""
    worker = handle.spawner.spawn(node, slot, slowdown)
    handle.slots[node] = slot
    return handle.workers.add(node, worker.handle)


def next_slot(handle: ClusterHandle) -> Slot:
    """Where a worker added by hand goes: the Ray node holding the fewest of this process's
    workers (the only node of an embedded cluster)."""
    slots = [s.cpu_only() for s in worker_slots(ray.nodes())]  # type: ignore[no-untyped-call]
    if not slots:
        raise ConfigError("the Ray cluster has no alive node to add a worker on")
    held = Counter(s.ray_node_id for s in handle.slots.values())
    return min(slots, key=lambda s: held[s.ray_node_id])


def shutdown(handle: ClusterHandle) -> None:
    """Stop what ``launch`` started: the actors it created (they share its fate anyway) and
    Ray if it started it. The actors of an embedded cluster that other databases of this
    process share stop with the last of them; a session that attached to the running actors
    of a Ray cluster leaves them."""
    last_user = handle.owns_actors
    if handle.prefix in _embedded_users:
        _embedded_users[handle.prefix] -= 1
        last_user = _embedded_users[handle.prefix] <= 0
        if last_user:
            del _embedded_users[handle.prefix]
            _embedded.pop(handle.data_dir, None)
    if last_user and ray.is_initialized():
        _stop_actors(handle)
    if handle.started_ray:
        release_ray()


def _stop_actors(handle: ClusterHandle, nodes: list[str] | None = None) -> None:
    """Give the data directory up and stop the coordinator and the workers of ``nodes``
    (default: those this process knows)."""
    try:  # the next cluster on this data directory takes it over at once
        handle.coordinator.release().get(RELEASE_TIMEOUT_S)
    except Error as error:
        log.info("the coordinator did not release the data directory: %s", error)
    for node in nodes if nodes is not None else handle.workers.known:
        handle.workers.stop(node)
    handle.coordinator.stop()
