"""Bringing the cluster up: an embedded local Ray bound to 127.0.0.1, or an existing Ray
cluster; the coordinator and worker actors on it; and taking them down again."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from shardflow.catalog import DataDir, OwnerToken, lease
from shardflow.config import Settings
from shardflow.errors import ConfigError, DataDirInUseError
from shardflow.runtime.actors import (
    COORDINATOR_CONCURRENCY,
    CoordinatorActor,
    check_storage_on,
    spawn_worker,
)
from shardflow.runtime.ray_workers import (
    NAMESPACE,
    RayWorker,
    RayWorkers,
    coordinator_actor_name,
)
from shardflow.runtime.raynode import DATA_NODE_RESOURCE, enable_token_auth, process_environment
from shardflow.runtime.slots import Slot, choose_slots, worker_slots
from shardflow.runtime.worker import default_memory_mb, local_root

if TYPE_CHECKING:
    from ray._private.node import Node

    from shardflow.runtime.ray_workers import CoordinatorHandle

log = logging.getLogger(__name__)
T = TypeVar("T")
LOOPBACK = "127.0.0.1"
_local_databases = 0
"""Open databases on the Ray instance this process started; it stops with the last one."""
_local_node: Node | None = None
"""The Ray node this process started for its embedded clusters."""
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
    slots: dict[str, Slot] = field(default_factory=dict)
    """Where each worker this process started runs."""
    detached: bool = False
    """Actors outlive the process that started them (a cluster joined by address)."""
    worker_settings: Settings | None = None


def start_ray(address: str | None, settings: Settings) -> bool:
    """Start or join Ray; returns True when the database uses a Ray instance this process
    started itself (and so must stop when the last such database closes)."""
    global _local_databases
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        embedded = bool(_local_databases)
        if address is not None and (embedded or not _same_address(address, current)):
            where = "an embedded cluster" if embedded else f"the Ray cluster at {current}"
            raise ConfigError(
                f"this process is connected to {where}; a process joins one Ray cluster "
                f"(close its databases first, or connect to {address} from another process)"
            )
        if embedded:
            _local_databases += 1
            return True
        return False
    if address is None:
        _start_local_ray(settings)
        _local_databases = 1
        return True
    _use_auth_token_if_present()
    kwargs: dict[str, Any] = {
        "namespace": NAMESPACE,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    if is_loopback(address):  # a cluster of this machine (`shardflow cluster up`)
        _pin_to_loopback()
        kwargs["_node_ip_address"] = LOOPBACK
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ConfigError(f"cannot join the Ray cluster at {address!r}: {error}") from None
    return False


def _start_local_ray(settings: Settings) -> None:
    """Start a new Ray instance for embedded clusters (never one `ray start` left behind)
    and connect this process to it. An embedded cluster serves this machine only: every
    server binds to 127.0.0.1, and token authentication is on, as in ``ray.init()``'s own
    local instances. The node is started here rather than by ``ray.init()`` to leave out
    two processes that serve nothing here but cost start-up time on a small machine
    (about a second of CPU together): the log monitor (worker logs are not sent to the
    driver) and the autoscaler's monitor (one machine, nothing to scale). Nor does it start
    Ray's API server (the dashboard process, which Ray starts even without its dashboard to
    serve usage statistics, and waits for): nothing of shardflow asks it anything, and its
    start was ~1.3 s of an embedded cluster's start here (``bench/startup.py``)."""
    global _local_node
    from ray._private.parameter import RayParams

    _pin_to_loopback()
    with _quiet("ray._private.authentication.authentication_token_setup"):
        enable_token_auth()  # "token authentication is enabled": as it should be
    params = RayParams(
        node_ip_address=LOOPBACK,
        num_cpus=max(os.cpu_count() or 1, 1),
        object_store_memory=settings.object_store_memory or None,
        include_dashboard=False,
        include_log_monitor=False,  # type: ignore[arg-type]  # a flag Ray annotates as str
        no_monitor=True,
    )
    with process_environment():
        node = _node_without_api_server()(
            params, head=True, shutdown_at_exit=False, spawn_reaper=True, ray_init_cluster=True
        )
    _local_node = node
    atexit.register(_stop_local_ray)  # a process that exits with databases open
    try:
        ray.init(
            address=node.gcs_address,
            _node_ip_address=LOOPBACK,
            namespace=NAMESPACE,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
    except BaseException:
        _stop_local_ray()
        raise


def _node_without_api_server() -> type[Node]:
    """Ray's head node class, less its API server process (see ``_start_local_ray``)."""
    from ray._private.node import Node

    class EmbeddedNode(Node):
        def start_api_server(
            self, *, include_dashboard: bool | None, raise_on_failure: bool
        ) -> None:
            self._webui_url = None  # what Ray records when its API server does not come up

    return EmbeddedNode


def _stop_local_ray() -> None:
    """Disconnect from the Ray instance this process started and stop its processes."""
    global _local_node
    node, _local_node = _local_node, None
    if node is None:
        return
    atexit.unregister(_stop_local_ray)
    if ray.is_initialized():
        ray.shutdown()
    node.destroy_external_storage()  # type: ignore[no-untyped-call]
    # waited for: a process object dropped while its process still runs warns
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


def _same_address(address: str, current: str) -> bool:
    if address == "auto":
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host == "localhost":
        host = LOOPBACK
    return f"{host}:{port}" == current


def is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``) names this machine's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _pin_to_loopback() -> None:
    """Make this process's Ray use 127.0.0.1 for itself and every node: with multi-node
    clusters allowed (Ray's default on Linux), Ray resolves 127.0.0.1 to the host's own
    network address and announces and dials that instead. Ray reads the switch when it is
    imported, so the loaded flag is set too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _use_auth_token_if_present() -> None:
    """Join a token-authenticated cluster (Ray's default) with the token this machine has;
    Ray only looks for it by itself when it starts a cluster."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    with _quiet(maybe_enable_token_auth_if_token_available.__module__):
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # see _quiet


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Only errors from these loggers meanwhile: Ray warns that token authentication is
    enabled, as it should be."""
    quieted = [logging.getLogger(name) for name in loggers]
    levels = [logger.level for logger in quieted]
    for logger in quieted:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(quieted, levels, strict=True):
            logger.setLevel(level)


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
            _release_ray()
        raise


def _release_ray() -> None:
    global _local_databases
    _local_databases -= 1
    if _local_databases <= 0:
        _local_databases = 0
        if ray.is_initialized():
            _no_auto_init()
            ray.shutdown()
        _stop_local_ray()


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
        prefix = service_prefix(data_dir)
    name = coordinator_actor_name(prefix)
    try:  # a cluster for this data directory already runs: attach to it
        running = cast("CoordinatorHandle", ray.get_actor(name, namespace=NAMESPACE))
        return ClusterHandle(
            prefix, data_dir, settings, running, RayWorkers(prefix), started, owns_actors=False
        )
    except ValueError:
        pass
    _refuse_if_owned(data_dir)
    embedded = address is None
    slots = choose_slots(worker_slots(ray.nodes()), workers, embedded)  # type: ignore[no-untyped-call]
    if not slots:
        raise ConfigError(f"the Ray cluster at {address} has no node to run workers on")
    owner = f"{prefix}-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {"lifetime": "detached"} if not embedded else {}
    coordinator = CoordinatorActor.options(
        name=name,
        namespace=NAMESPACE,
        max_restarts=-1,
        max_concurrency=COORDINATOR_CONCURRENCY,
        num_cpus=0,
        **options,
        **_data_node_share(slots),
    ).remote(data_dir, settings, prefix, owner, _describe(address), not embedded)
    handle = ClusterHandle(
        prefix,
        data_dir,
        settings,
        coordinator,
        RayWorkers(prefix),
        started,
        detached=not embedded,
    )
    if embedded and not settings.engine_threads:
        # Workers of an embedded cluster share this machine's cores: oversubscribing them
        # with one DuckDB thread per core in every worker measured ~8 % slower on TPC-H.
        settings = settings.replace(engine_threads=max(1, (os.cpu_count() or 1) // len(slots)))
    if embedded and not settings.worker_memory_mb:
        # and its memory: each worker's DuckDB gets its share, spilling beyond it
        settings = settings.replace(worker_memory_mb=default_memory_mb(len(slots)))
    nodes = [f"node-{i}" for i in range(len(slots))]
    handle.worker_settings = settings
    try:
        if embedded:
            # The workers start while the coordinator does: on a small machine start-up is
            # mostly processes starting. One that read the catalog before the nodes were
            # registered catches up below.
            registered = handle.coordinator.register_nodes.remote(nodes)
            for node, slot in zip(nodes, slots, strict=True):
                start_worker(handle, node, slot, simulate.get(node, 1.0))
            catalog = _coordinator_answer(registered, data_dir)
        else:
            _coordinator_answer(handle.coordinator.ping.remote(), data_dir)
            owner_token = ray.get(handle.coordinator.owner_token.remote())
            _check_coordinator_storage(handle, owner_token)
            check_storage_on(slots, data_dir, owner_token)
            catalog = ray.get(handle.coordinator.register_nodes.remote(nodes))
            for node, slot in zip(nodes, slots, strict=True):
                start_worker(handle, node, slot, simulate.get(node, 1.0))
        replies = {node: handle.workers.get(node).info() for node in nodes}
        infos = {node: reply.get() for node, reply in replies.items()}  # loaded and serving
        behind = [n for n, info in infos.items() if info.catalog_version < catalog["version"]]
        for reply in [handle.workers.get(node).sync(catalog) for node in behind]:
            reply.get()
        for node, info in infos.items():  # one at a time: they would slow each other down
            if not info.profile.calibration:  # not started with a kept calibration
                handle.workers.get(node).calibrate().get()
    except BaseException:
        _stop_actors(handle)  # nothing half-started stays behind
        raise
    if embedded:
        _embedded[data_dir] = handle
        _embedded_users[prefix] = 1
    else:
        ray.get(handle.coordinator.start_joining.remote())
    return handle


def _coordinator_answer(ref: ray.ObjectRef[T], data_dir: str) -> T:
    """The new coordinator's first answer; it is gone when another cluster took the data
    directory's lease meanwhile (said so)."""
    try:
        return ray.get(ref)
    except RayActorError:
        _refuse_if_owned(data_dir)
        raise


def _check_coordinator_storage(handle: ClusterHandle, owner: OwnerToken) -> None:
    """The coordinator took the lease in the data directory this process sees: otherwise it
    runs on a node whose own disk holds that path."""
    record = lease.read_lease(DataDir.resolve(handle.data_dir))
    if record is not None and record.owner == owner.owner:
        return
    host = ray.get(handle.coordinator.ray_node_id.remote())
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
            coordinator = ray.get_actor(coordinator_actor_name(prefix), namespace=NAMESPACE)
        except ValueError:
            raise ConfigError(f"no shardflow service serves {data_dir} at {address}") from None
        handle = ClusterHandle(
            prefix, data_dir, Settings(), cast("CoordinatorHandle", coordinator), RayWorkers(prefix)
        )
        try:
            catalog = ray.get(handle.coordinator.catalog.remote(), timeout=RELEASE_TIMEOUT_S)
            count = int(catalog.get("next_node_index", 0))
        except (RayActorError, RayTaskError, GetTimeoutError):
            count = 0
        nodes = [f"node-{i}" for i in range(count)]  # every worker it ever started
        _stop_actors(handle, nodes)
        return nodes
    finally:
        if started:
            _release_ray()
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
        return f"the embedded cluster of pid {os.getpid()} ({' '.join(sys.argv)[:80]})"
    return f"on the Ray cluster at {address}"


def start_worker(handle: ClusterHandle, node: str, slot: Slot, slowdown: float = 1.0) -> RayWorker:
    """Create the worker actor of ``node`` on ``slot``; it loads what the catalog assigns
    it. A ``slowdown`` above 1 makes it a simulated slower device (tests and demos)."""
    settings = handle.worker_settings or handle.settings
    actor = spawn_worker(
        handle.prefix, node, handle.data_dir, settings, slot, handle.detached, slowdown
    )
    handle.slots[node] = slot
    return handle.workers.add(node, actor)


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
        _release_ray()


def _stop_actors(handle: ClusterHandle, nodes: list[str] | None = None) -> None:
    """Give the data directory up and stop the coordinator and the workers of ``nodes``
    (default: those this process knows)."""
    try:  # the next cluster on this data directory takes it over at once
        ray.get(handle.coordinator.release.remote(), timeout=RELEASE_TIMEOUT_S)
    except (RayActorError, RayTaskError, GetTimeoutError) as error:
        log.info("the coordinator did not release the data directory: %s", error)
    for node in nodes if nodes is not None else handle.workers.known:
        handle.workers.kill(node)
    try:
        ray.kill(cast("ray.actor.ActorHandle[Any]", handle.coordinator), no_restart=True)
    except ValueError:  # gone already
        pass
