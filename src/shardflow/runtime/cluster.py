"""Bringing the cluster up: an embedded local Ray bound to 127.0.0.1, or an existing Ray
cluster; the coordinator and worker actors on it; and taking them down again."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from shardflow.catalog import DataDir, lease
from shardflow.config import Settings
from shardflow.errors import ConfigError, DataDirInUseError
from shardflow.runtime.actors import (
    COORDINATOR_CONCURRENCY,
    WORKER_CONCURRENCY,
    CoordinatorActor,
    WorkerActor,
)
from shardflow.runtime.ray_workers import (
    NAMESPACE,
    RayWorker,
    RayWorkers,
    coordinator_actor_name,
    worker_actor_name,
)

if TYPE_CHECKING:
    from shardflow.runtime.ray_workers import CoordinatorHandle

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
_local_databases = 0
"""Open databases on the Ray instance this process started; it stops with the last one."""
_embedded: dict[str, ClusterHandle] = {}
"""The embedded cluster serving each data directory in this process (one owner per data
directory: a second ``connect`` to it shares these actors)."""
_embedded_users: Counter[str] = Counter()
"""Open databases per embedded cluster (by prefix); its actors stop with the last one."""
RELEASE_TIMEOUT_S = 5.0


@dataclass
class ClusterHandle:
    """The actors a session talks to, and what ``close`` must undo."""

    prefix: str
    data_dir: str
    settings: Settings
    coordinator: CoordinatorHandle
    workers: RayWorkers
    started_ray: bool = False
    owns_actors: bool = True
    worker_resources: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    node_resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per node, actor options that replace ``worker_resources`` (a GPU worker's GPU)."""
    worker_settings: Settings | None = None


def start_ray(address: str | None, settings: Settings) -> bool:
    """Start or join Ray; returns True when the database uses a Ray instance this process
    started itself (and so must stop when the last such database closes)."""
    global _local_databases
    if ray.is_initialized():
        if _local_databases:
            _local_databases += 1
            return True
        return False
    if address is None:
        # An embedded cluster serves this machine only: every server binds to 127.0.0.1.
        # (Ray read the switch when it was imported; a process that imported Ray before
        # shardflow gets it set here too.)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        kwargs: dict[str, Any] = {
            "address": "local",  # always a new instance, never one `ray start` left behind
            "num_cpus": max(os.cpu_count() or 1, 1),
            "include_dashboard": False,
            "_node_ip_address": LOOPBACK,
            "namespace": NAMESPACE,
            "logging_level": logging.ERROR,
            "log_to_driver": False,
        }
        if settings.object_store_memory:
            kwargs["object_store_memory"] = settings.object_store_memory
        ray.init(**kwargs)
        _local_databases = 1
        return True
    _use_auth_token_if_present()
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ConfigError(f"cannot join the Ray cluster at {address!r}: {error}") from None
    return False


def _use_auth_token_if_present() -> None:
    """Join a token-authenticated cluster (Ray's default) with the token this machine has;
    Ray only looks for it by itself when it starts a cluster."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def gpu_slots(nodes: list[dict[str, Any]]) -> list[str | None]:
    """One entry per GPU of the alive Ray nodes: the node's accelerator type (Ray's
    ``accelerator_type:<type>`` resource, e.g. "H200" or "AMD-Instinct-MI300X"), or None
    where Ray does not name it. ``nodes`` is what ``ray.nodes()`` returns."""
    slots: list[str | None] = []
    for node in nodes:
        if not node.get("Alive", True):
            continue
        resources = node.get("Resources", {})
        types = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
        slots += [types[0] if types else None] * int(resources.get("GPU", 0))
    return sorted(slots, key=lambda t: t or "")


def gpu_resources(accelerator: str | None) -> dict[str, Any]:
    """Actor options for a worker that owns one GPU of this accelerator type."""
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1}
    if accelerator:  # the share Ray itself asks for with accelerator_type=...
        options["resources"] = {f"accelerator_type:{accelerator}": 0.001}
    return options


def launch(
    address: str | None,
    workers: int | None,
    data_dir: str,
    settings: Settings,
    simulate: Mapping[str, float] | None = None,
) -> ClusterHandle:
    """Start (or attach to) the coordinator and the workers."""
    started = start_ray(address, settings)
    try:
        return _launch_actors(address, workers, data_dir, settings, started, simulate or {})
    except BaseException:
        if started:
            _release_ray()
        raise


def _release_ray() -> None:
    global _local_databases
    _local_databases -= 1
    if _local_databases <= 0 and ray.is_initialized():
        _local_databases = 0
        _no_auto_init()
        ray.shutdown()


def _no_auto_init() -> None:
    """Turn off Ray's auto-init in this process. Without it, a Ray call still in flight on
    another thread when shardflow shuts its Ray down would start a fresh, empty local Ray
    and wait on it for ever; with it off the call fails at once (and ends as a
    ``ClosedError``). shardflow always starts Ray itself. Ray reads the switch
    (``RAY_ENABLE_AUTO_CONNECT=0``) when it is imported, so the loaded flag is set too."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def _launch_actors(
    address: str | None,
    workers: int | None,
    data_dir: str,
    settings: Settings,
    started: bool,
    simulate: Mapping[str, float],
) -> ClusterHandle:
    if address is None:
        serving = _embedded.get(data_dir)
        if serving is not None:  # this process serves the data directory already: share it
            _embedded_users[serving.prefix] += 1
            return dataclasses.replace(serving, started_ray=started, owns_actors=False)
        prefix = f"local-{uuid.uuid4().hex[:8]}"  # several embedded databases never collide
    else:  # sessions on one Ray cluster and one data directory share the actors
        prefix = f"db-{uuid.uuid5(uuid.NAMESPACE_URL, data_dir).hex[:12]}"
    name = coordinator_actor_name(prefix)
    try:  # a cluster for this data directory already runs: attach to it
        running = cast("CoordinatorHandle", ray.get_actor(name, namespace=NAMESPACE))
        return ClusterHandle(
            prefix, data_dir, settings, running, RayWorkers(prefix), started, owns_actors=False
        )
    except ValueError:
        pass
    _refuse_if_owned(data_dir)
    gpus = gpu_slots(ray.nodes())  # type: ignore[no-untyped-call]
    count = workers if workers is not None else (len(gpus) or 4)
    owner = f"{prefix}-{uuid.uuid4().hex[:12]}"
    coordinator = CoordinatorActor.options(
        name=name,
        namespace=NAMESPACE,
        max_restarts=-1,
        max_concurrency=COORDINATOR_CONCURRENCY,
        num_cpus=0,
    ).remote(data_dir, settings, prefix, owner, _describe(address))
    try:
        ray.get(coordinator.ping.remote())
    except RayActorError:
        _refuse_if_owned(data_dir)  # another cluster took the lease meanwhile
        raise
    handle = ClusterHandle(prefix, data_dir, settings, coordinator, RayWorkers(prefix), started)
    if address is None and not settings.engine_threads:
        # Workers of an embedded cluster share this machine's cores: oversubscribing them
        # with one DuckDB thread per core in every worker measured ~8 % slower on TPC-H.
        settings = settings.replace(engine_threads=max(1, (os.cpu_count() or 1) // count))
    nodes = [f"node-{i}" for i in range(count)]
    ray.get(handle.coordinator.register_nodes.remote(nodes))
    handle.worker_settings = settings
    for i, node in enumerate(nodes):
        if gpus and workers is None:  # one worker per GPU, pinned to its accelerator type
            handle.node_resources[node] = gpu_resources(gpus[i])
        start_worker(handle, node, simulate.get(node, 1.0))
    for reply in [handle.workers.get(node).info() for node in nodes]:
        reply.get()  # loaded and serving
    for node in nodes:  # one at a time: they would slow each other down
        handle.workers.get(node).calibrate().get()
    if address is None:
        _embedded[data_dir] = handle
        _embedded_users[prefix] = 1
    return handle


def _refuse_if_owned(data_dir: str) -> None:
    """Say so, before anything starts, when another live cluster owns ``data_dir``."""
    directory = DataDir.resolve(data_dir)
    record = lease.read_lease(directory)
    now = time.time()
    if record is not None and not lease.vacant(record, owner="", now=now):
        raise DataDirInUseError(lease.in_use_message(directory, record, now))


def _describe(address: str | None) -> str:
    if address is None:
        return f"the embedded cluster of pid {os.getpid()} ({' '.join(sys.argv)[:80]})"
    return f"on the Ray cluster at {address}"


def start_worker(handle: ClusterHandle, node: str, slowdown: float = 1.0) -> RayWorker:
    """Create the worker actor of ``node``; it loads what the catalog assigns it. A
    ``slowdown`` above 1 makes it a simulated slower device (tests and demos)."""
    actor = WorkerActor.options(
        name=worker_actor_name(handle.prefix, node),
        namespace=NAMESPACE,
        max_restarts=0,  # a dead worker stays dead: the coordinator reassigns its shards
        max_concurrency=WORKER_CONCURRENCY,
        **handle.node_resources.get(node, handle.worker_resources),
    ).remote(
        node,
        handle.data_dir,
        handle.worker_settings or handle.settings,
        handle.prefix,
        slowdown,
    )
    return handle.workers.add(node, actor)


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
        try:  # the next cluster on this data directory takes it over at once
            ray.get(handle.coordinator.release.remote(), timeout=RELEASE_TIMEOUT_S)
        except (RayActorError, RayTaskError, GetTimeoutError) as error:
            log.info("the coordinator did not release the data directory: %s", error)
        for node in handle.workers.known:
            handle.workers.kill(node)
        ray.kill(cast("ray.actor.ActorHandle[Any]", handle.coordinator), no_restart=True)
    if handle.started_ray:
        _release_ray()
