"""One Ray node of a local multi-node cluster, as a process of its own.

``python -m shardflow.tools.raynode --info FILE [--head | --address GCS]`` starts a Ray node
— its own raylet and object store (the head also its GCS) — bound to 127.0.0.1 (or to the
address ``--ip`` gives, in a network namespace of its own), writes what it started to
``FILE`` and serves until it is told to stop (SIGTERM, SIGINT) or its raylet exits. Every
process of the node descends from this process (Ray gives each worker a process group of
its own), so SIGKILL to the tree takes the whole node away at once, as a machine that dies
would. ``tools/localcluster.py`` starts it; the node itself is started as
``runtime/ray/node.py`` says.

A head that keeps its state in Redis (``--redis``, the password in ``SHARDFLOW_REDIS_PASSWORD``)
can be started with ``--keep``: this process then starts the head as a child of its own and
starts it again whenever it dies, as Kubernetes restarts a head pod.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shardflow.config import LOOPBACK
from shardflow.runtime.ray.names import DATA_NODE_RESOURCE, NAME_LABEL
from shardflow.runtime.ray.node import (
    PROCESS_ENVIRONMENT,
    GcsStore,
    enable_token_auth,
    raylet_ended,
    start_node,
)

FORGET_VARIABLE = "SHARDFLOW_TEST_HEAD_FORGETS"
"""Tests only: "1" makes the keeper start the head again without its Redis, as a cluster
without fault tolerance would (its test must then fail)."""
PASSWORD_VARIABLE = "SHARDFLOW_REDIS_PASSWORD"
"""The Redis password of ``--redis`` (kept off the command line, which every user sees)."""
RESTART_PAUSE_S = 0.5
RAYLET_POLL_S = 0.5
STOP_TIMEOUT_S = 20.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--info", required=True, help="where to write what was started")
    parser.add_argument("--head", action="store_true", help="start the GCS (the head node)")
    parser.add_argument("--address", help="the GCS address of the head (other nodes)")
    parser.add_argument("--num-cpus", type=int, default=1)
    parser.add_argument("--object-store-mb", type=int, default=200)
    parser.add_argument("--data", action="store_true", help="serve shards on this node")
    parser.add_argument("--name", default="", help="the node's name in `cluster status`")
    parser.add_argument("--port", type=int, help="the head's GCS port (the same after restarts)")
    parser.add_argument("--temp-dir", help="Ray's folder for the head (one of its own)")
    parser.add_argument("--redis", help="host:port of the Redis that keeps the head's state")
    parser.add_argument("--namespace", default="shardflow", help="this cluster's prefix there")
    parser.add_argument("--keep", action="store_true", help="start the head again when it dies")
    parser.add_argument("--ip", default=LOOPBACK, help="the node's address (default: loopback)")
    args = parser.parse_args(argv)
    if args.head == bool(args.address):
        parser.error("give exactly one of --head and --address")
    if args.keep and not (args.head and args.redis and args.port):
        parser.error("--keep keeps a head with --redis and --port (one without loses the cluster)")
    if args.keep:
        keep([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--keep"], args.info)
        return
    # Set before Ray is imported (it reads them then): every address resolves to loopback.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for key, value in PROCESS_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    enable_token_auth()
    resources = {DATA_NODE_RESOURCE: 1.0} if args.data else {}
    labels = {NAME_LABEL: args.name} if args.name else {}
    password = os.environ.pop(PASSWORD_VARIABLE, "")
    store = GcsStore(args.redis, password, args.namespace) if args.redis else None
    node = start_node(
        args.head,
        args.address,
        args.num_cpus,
        args.object_store_mb << 20,
        resources,
        labels,
        store,
        args.port,
        args.temp_dir,
        args.ip,
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
    while not stop.wait(RAYLET_POLL_S):
        if raylet_ended(node):  # declared dead by the head: this node is over
            print(f"the raylet of {args.name or 'this node'} exited; the node stops", flush=True)
            break
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


def keep(argv: list[str], info: str) -> None:
    """Run the head (``raynode`` with ``argv``) as a child, and start it again each time it
    ends unasked, until this process is told to stop (then the head is stopped first). The
    head writes ``info`` each time it has started; it is removed while the head is down."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    password = os.environ.get(PASSWORD_VARIABLE, "")
    starts = 0
    while not stop.is_set():
        environment = dict(os.environ, **{PASSWORD_VARIABLE: password})
        command = [sys.executable, "-m", "shardflow.tools.raynode", *argv]
        # its own process group: a crash of the head (SIGKILL to it and its processes)
        # leaves this keeper alive
        head = subprocess.Popen(command, env=environment, start_new_session=True)
        starts += 1
        while head.poll() is None and not stop.wait(0.2):
            pass
        if stop.is_set():
            head.terminate()
            try:
                head.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait()
            return
        print(
            f"{time.strftime('%H:%M:%S')} the head (pid {head.pid}) ended with exit code "
            f"{head.returncode}: starting it again (start {starts + 1})",
            flush=True,
        )
        if os.environ.get(FORGET_VARIABLE) == "1" and "--redis" in argv:
            at = argv.index("--redis")
            argv = argv[:at] + argv[at + 2 :]
        Path(info).unlink(missing_ok=True)
        stop.wait(RESTART_PAUSE_S)


if __name__ == "__main__":
    main()
