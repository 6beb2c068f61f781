"""What the coordinator shows: the cluster as the metrics endpoint and the console page see
it, read from the controller and the workers' reports at scrape time."""

from __future__ import annotations

import time
from collections import Counter

from shardflow.control.migration import MigrationState, Phase
from shardflow.errors import Error, WorkerGone
from shardflow.runtime.coordinator.controller import Controller
from shardflow.runtime.protocol import ReplicaInfo, Reply, ShardInfo, WorkerInfo
from shardflow.telemetry import console
from shardflow.telemetry.console import ConsoleState, FailoverView, MoveView, NodeView, ShardView
from shardflow.telemetry.devices import NodeProfile
from shardflow.telemetry.metrics import ClusterGauges, NodeGauges

CONSOLE_REPORT_S = 2.0
"""How long the console's snapshot waits for the workers' reports, all together: a worker
that does not answer by then is shown as not alive, and the page still refreshes."""


def gauges(controller: Controller) -> ClusterGauges:
    """The cluster as the metrics endpoint shows it, read from the workers now."""
    replies: dict[str, Reply[WorkerInfo]] = {}
    for node in controller.state.catalog.nodes:
        try:
            replies[node] = controller.workers.get(node).info()
        except WorkerGone:
            continue
    capacities = controller.state.capacities(list(replies))
    nodes = []
    for node, reply in replies.items():
        try:
            info = reply.get(timeout=5)
        except Error:
            continue
        nodes.append(
            NodeGauges(
                node=node,
                utilization=controller.utilization.get(node, 0.0),
                device_utilization=info.device.utilization,
                device_memory_used_bytes=info.device.memory_used_bytes,
                device_memory_free_bytes=info.device.memory_free_bytes,
                memory_used_bytes=info.memory.used_bytes,
                memory_free_bytes=info.memory.free_bytes,
                engine_memory_bytes=info.memory.engine_bytes,
                spilled_bytes=info.memory.spilled_bytes,
                memory_limit_bytes=info.memory.limit_bytes,
                queries_running=info.queries_running,
                shards=len(info.shards),
                bytes=sum(s.bytes for s in info.shards),
                capacity=capacities[node],
                failure_rate=controller.health.rate(node, time.monotonic())[0],
                suspect=node in controller.state.excluded,
                device_cache_bytes=info.device_cache.bytes if info.device_cache else None,
                device_cache_hit_rate=info.device_cache.hit_rate if info.device_cache else None,
            )
        )
    acted = Counter(
        "true" if not d["dry_run"] and d["actions"] else "false" for d in controller.decisions
    )
    return ClusterGauges(nodes, len(controller.failovers), dict(acted))


def console_state(controller: Controller) -> ConsoleState:
    """The cluster as the console page shows it: the shard map and moves from what the
    coordinator holds, the nodes as their workers report now (asked all at once)."""
    catalog = controller.state.catalog
    replies: dict[str, Reply[WorkerInfo]] = {}
    for node in catalog.nodes:
        try:
            replies[node] = controller.workers.get(node).info()
        except WorkerGone:
            continue
    deadline = time.monotonic() + CONSOLE_REPORT_S
    infos: dict[str, WorkerInfo] = {}
    for node, reply in replies.items():
        try:
            infos[node] = reply.get(timeout=max(0.01, deadline - time.monotonic()))
        except Error:
            continue
    capacities = controller.state.capacities(list(catalog.nodes))
    nodes = tuple(
        node_view(
            node,
            infos.get(node),
            controller.state.profiles.get(node),
            capacities[node],
            controller.utilization.get(node),
        )
        for node in catalog.nodes
    )
    shards = tuple(
        ShardView(f"{table}#{unit.unit_id}", table, unit.unit_id, unit.node, unit.lo, unit.hi)
        for group in catalog.groups.values()
        for table in catalog.group_tables(group.group_id)
        for unit in group.units
    )
    history = list(controller.migrator.history)
    moves = [s for s in history if not s.done]
    rollbacks = [s for s in history if s.phase is Phase.ROLLED_BACK][-console.RECENT :]
    failovers = controller.failovers[-console.RECENT :]
    rate = controller.recorder.query_rate if controller.recorder is not None else None
    return ConsoleState(
        at=time.time(),
        buckets=catalog.n_buckets,
        epoch=catalog.epoch,
        nodes=nodes,
        shards=shards,
        moves=tuple(move_view(s, catalog.group_tables(s.plan.group)) for s in moves),
        rollbacks=tuple(
            move_view(s, catalog.group_tables(s.plan.group)) for s in reversed(rollbacks)
        ),
        failovers=tuple(
            FailoverView(f.node, f.detected_at, f.units, f.seconds) for f in reversed(failovers)
        ),
        qps=rate.rate() if rate is not None else 0.0,
        queries=rate.total if rate is not None else 0,
    )


def move_view(state: MigrationState, tables: list[str]) -> MoveView:
    """A move as the console lists it."""
    plan = state.plan
    return MoveView(
        move_id=plan.move_id,
        kind=plan.kind,
        shards=tuple(f"{t}#{s.unit_id}" for t in tables for s in plan.sources),
        from_nodes=tuple(sorted({s.node for s in plan.sources})),
        to_nodes=tuple(sorted({u.node for u in plan.targets})),
        phase=state.phase.value,
        outcome=state.outcome,
        started_at=state.started_at,
        seconds=(state.finished_at or time.time()) - state.started_at,
    )


def node_view(
    node: str,
    info: WorkerInfo | None,
    profile: NodeProfile | None,
    capacity: float,
    utilization: float | None,
) -> NodeView:
    """A node as the console lists it; one whose worker did not answer is not alive, with
    the device it reported when it joined (if the coordinator has it) and nothing held."""
    if info is None:
        return NodeView(
            name=node,
            alive=False,
            vendor=profile.vendor if profile is not None else "unknown",
            model=profile.model if profile is not None else "unknown",
            engine=profile.engine if profile is not None else "unknown",
            simulated=profile.simulated if profile is not None else False,
            capacity=capacity,
            utilization=utilization,
            device_utilization=None,
            shards=0,
            rows=0,
            bytes=0,
            queries_running=0,
        )
    held: list[ShardInfo | ReplicaInfo] = [*info.shards, *info.replicas]
    return NodeView(
        name=node,
        alive=True,
        vendor=info.profile.vendor,
        model=info.profile.model,
        engine=info.profile.engine,
        simulated=info.profile.simulated,
        capacity=capacity,
        utilization=utilization,
        device_utilization=info.device.utilization,
        shards=len(info.shards),
        rows=sum(s.rows for s in held),
        bytes=sum(s.bytes for s in held),
        queries_running=info.queries_running,
    )
