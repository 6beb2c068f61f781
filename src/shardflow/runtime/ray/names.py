"""Names and constants of shardflow on Ray, once: the namespace and actor names, the Ray
resource and label of data nodes, and how the actors run."""

from __future__ import annotations

NAMESPACE = "shardflow"
"""The Ray namespace of every shardflow actor."""

DATA_NODE_RESOURCE = "shardflow"
"""The Ray resource of nodes that serve shards (a head started for control only lacks it)."""

NAME_LABEL = "shardflow-name"
"""The Ray node label that names a node in ``shardflow cluster status``."""

WORKER_CONCURRENCY = 16
"""Calls a worker actor runs at once (fragments, inserts, a move's steps)."""
COORDINATOR_CONCURRENCY = 16

SWITCH_INTERVAL_S = 0.001
"""How long a thread of a coordinator or worker process may keep the GIL while another
waits for it (Python's default is 5 ms). A control call — a move's fence, its retire —
waits for the GIL behind the fragments' and the copy's threads several times on its way:
under bench/elasticity.py's load the fence's own phase took p50 29-36 ms at 5 ms and
11-15 ms at 1 ms. The process runs nothing but its actor."""


def worker_actor_name(prefix: str, node: str) -> str:
    return f"{prefix}-worker-{node}"


def coordinator_actor_name(prefix: str) -> str:
    return f"{prefix}-coordinator"
