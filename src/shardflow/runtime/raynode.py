"""One Ray node of a local multi-node cluster, as a process of its own.

``python -m shardflow.runtime.raynode --info FILE [--head | --address GCS]`` starts a Ray
node — its own raylet and object store (the head also its GCS) — bound to 127.0.0.1, writes
what it started to ``FILE`` and serves until it is told to stop (SIGTERM, SIGINT). Every
process of the node is in this process's process group, so one ``SIGKILL`` to the group
takes the whole node away at once, as a machine that dies would.

Why not ``ray start``: Ray's command line turns 127.0.0.1 into the host's own network
address once multi-node clusters are allowed, and refuses them otherwise. Ray's node API
keeps the address it is given, and with every node at 127.0.0.1 its servers listen on
loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
DATA_NODE_RESOURCE = "shardflow"
"""The Ray resource of nodes that serve shards (a head started for control only lacks it)."""
FAST_FAILURE_DETECTION = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
"""The GCS declares a node dead after 3 missed health checks 1 s apart (Ray's defaults wait
about 15 s), so that a lost node's shards are served again within seconds. On loopback no
check is missed for any other reason."""
NAME_LABEL = "shardflow-name"
"""The Ray node label that names a node in ``shardflow cluster status``."""
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


def start_node(
    head: bool,
    address: str | None,
    num_cpus: int,
    object_store_memory: int,
    resources: dict[str, float],
    labels: dict[str, str],
) -> Any:
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params: dict[str, Any] = {
        "node_ip_address": LOOPBACK,
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
    else:
        params |= {"gcs_address": address, "include_log_monitor": False}
    ray_params = RayParams(**params)
    if not head:
        ray_params.dashboard_agent_listen_port = None  # any free port, not the head's
    return Node(ray_params, head=head, shutdown_at_exit=True, spawn_reaper=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--info", required=True, help="where to write what was started")
    parser.add_argument("--head", action="store_true", help="start the GCS (the head node)")
    parser.add_argument("--address", help="the GCS address of the head (other nodes)")
    parser.add_argument("--num-cpus", type=int, default=1)
    parser.add_argument("--object-store-mb", type=int, default=200)
    parser.add_argument("--data", action="store_true", help="serve shards on this node")
    parser.add_argument("--name", default="", help="the node's name in `cluster status`")
    args = parser.parse_args(argv)
    if args.head == bool(args.address):
        parser.error("give exactly one of --head and --address")
    # Set before Ray is imported (it reads them then): every address resolves to loopback.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for key, value in PROCESS_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    enable_token_auth()
    resources = {DATA_NODE_RESOURCE: 1.0} if args.data else {}
    labels = {NAME_LABEL: args.name} if args.name else {}
    node = start_node(
        args.head,
        args.address,
        args.num_cpus,
        args.object_store_mb << 20,
        resources,
        labels,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    info = {
        "name": args.name,
        "pid": os.getpid(),
        "head": args.head,
        "node_id": node.node_id,
        "gcs_address": node.gcs_address,
        "session_dir": node.get_session_dir_path(),
    }
    target = Path(args.info)
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(info))
    partial.replace(target)
    stop.wait()
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


if __name__ == "__main__":
    main()
