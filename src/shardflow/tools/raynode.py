"""One Ray node of a local multi-node cluster, as a process of its own.

``python -m shardflow.tools.raynode --info FILE [--head | --address GCS]`` starts a Ray node
— its own raylet and object store (the head also its GCS) — bound to 127.0.0.1, writes what
it started to ``FILE`` and serves until it is told to stop (SIGTERM, SIGINT). Every process
of the node is in this process's process group, so one ``SIGKILL`` to the group takes the
whole node away at once, as a machine that dies would. ``tools/localcluster.py`` starts it;
the node itself is started as ``runtime/ray/node.py`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path

from shardflow.runtime.ray.names import DATA_NODE_RESOURCE, NAME_LABEL
from shardflow.runtime.ray.node import PROCESS_ENVIRONMENT, enable_token_auth, start_node


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
