"""A Ray node's environment and start: the variables its processes get, token
authentication, and a node started through Ray's node API bound to 127.0.0.1 (the local
cluster's node processes, ``shardflow.tools.raynode``, run it).

Why not ``ray start``: Ray's command line turns 127.0.0.1 into the host's own network
address once multi-node clusters are allowed, and refuses them otherwise. Ray's node API
keeps the address it is given, and with every node at 127.0.0.1 its servers listen on
loopback only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardflow.config import LOOPBACK

FAST_FAILURE_DETECTION = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
"""The GCS declares a node dead after 3 missed health checks 1 s apart (Ray's defaults wait
about 15 s), so that a lost node's shards are served again within seconds. On loopback no
check is missed for any other reason."""
PROCESS_ENVIRONMENT = {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"}
"""Set for the processes a node starts, where the environment has no value of its own.

Arrow's allocator: its default, mimalloc, keeps the pages a thread freed in that thread's
heap, and a worker allocates on the many threads Ray runs its calls on. After loading
TPC-H SF 1 (lineitem and orders) on four workers, each still held ~150 MB that nothing
used, about three times DuckDB's compressed copy of its shards; with jemalloc, which
returns freed pages after a second, none (``bench/memory.py``). Arrow reads the variable
once, when a process first allocates: it has to be in the worker's environment when it
starts (Kubernetes manifests set it on the containers)."""


@contextlib.contextmanager
def process_environment() -> Iterator[None]:
    """:data:`PROCESS_ENVIRONMENT` in ``os.environ`` meanwhile (the processes started
    meanwhile inherit it), as it was afterwards."""
    added = {k: v for k, v in PROCESS_ENVIRONMENT.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def enable_token_auth() -> None:
    """Token authentication on, as Ray's own local clusters have it: the token this user
    has (made once, where Ray keeps it) signs every call between nodes and drivers."""
    from ray._private.authentication import authentication_token_setup as auth

    auth.enable_token_auth_by_default()
    auth.ensure_token_if_auth_enabled(create_token_if_missing=True)


@dataclass(frozen=True)
class GcsStore:
    """Where the head keeps the cluster's state, so that a head started again takes the
    cluster back (Ray's GCS fault tolerance): a Redis server, the password it wants, and the
    key prefix of this cluster (several clusters may share one Redis)."""

    address: str
    password: str
    namespace: str


def start_node(
    head: bool,
    address: str | None,
    num_cpus: int,
    object_store_memory: int,
    resources: dict[str, float],
    labels: dict[str, str],
    store: GcsStore | None = None,
    port: int | None = None,
    temp_dir: str | None = None,
    ip: str = LOOPBACK,
) -> Any:
    """Start a Ray node. A head may be given its GCS ``port`` (a head started again must
    be found where it was) and a ``temp_dir`` (Ray's folder) of its own: Ray attaches a
    driver to the head first among the nodes of the driver's folder, and drivers on this
    machine must outlive a head that dies. Other nodes keep Ray's default folder (by
    default they would take the head's). ``ip``: the node's address (loopback, or its own
    in a network namespace of the local cluster, ``tools/netns.py``)."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params: dict[str, Any] = {
        "node_ip_address": ip,
        "num_cpus": num_cpus,
        "num_gpus": 0,
        "resources": resources,
        "labels": labels,
        "object_store_memory": object_store_memory,
        "min_worker_port": 0,
        "max_worker_port": 0,
        "node_manager_port": 0,
        "include_dashboard": False,
    }
    if head:
        params["_system_config"] = FAST_FAILURE_DETECTION
        params |= {"gcs_server_port": port, "temp_dir": temp_dir}
        if store is not None:  # Ray reads the store's address and prefix from the environment
            os.environ["RAY_REDIS_ADDRESS"] = store.address
            os.environ["RAY_external_storage_namespace"] = store.namespace
            params["redis_password"] = store.password
    else:
        params |= {
            "gcs_address": address,
            "include_log_monitor": False,
            "temp_dir": temp_dir or get_default_ray_temp_dir(),  # type: ignore[no-untyped-call]
        }
    ray_params = RayParams(**params)
    if not head:
        ray_params.dashboard_agent_listen_port = None  # any free port, not the head's
    return Node(ray_params, head=head, shutdown_at_exit=True, spawn_reaper=True)


def raylet_ended(node: Any) -> bool:
    """Whether a node's raylet has exited (and is reaped: Ray never waits for it). A raylet
    that learns the GCS declared its node dead (cut off from the head for a while) exits by
    itself; the node is over then."""
    from ray._private import ray_constants

    raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    return any(info.process.poll() is not None for info in raylets)
