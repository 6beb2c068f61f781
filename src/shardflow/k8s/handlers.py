"""What the operator does, as plain functions: reconcile a ``ShardflowCluster`` (scale-downs
drain first) and carry out a ``ShardMigration``. Kubernetes and the shardflow service are
injected (:class:`Kube`, :class:`Control`): the kopf wiring in :mod:`.operator` passes the
API server and ``shardflow.connect("grpc://...")``; tests pass a real service and an
in-memory Kubernetes. Reconciling goes in two steps: observe, then take the next step."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from shardflow.errors import (
    ClusterError,
    ConfigError,
    Error,
    MigrationError,
    MoveCancelled,
    MoveRefusedError,
)
from shardflow.k8s.render import ClusterSpec, NodeGroup, cluster_spec, render
from shardflow.records import MigrationRecord, NodeInfo

DRAIN_DEADLINE_S = 600.0
"""How long the shards of one pod going away may take to move before the scale-down waits
for the next reconcile (the pod stays until they moved)."""
POLL_S = 0.2
"""How often a running ``ShardMigration`` reads the move's phase for its status."""
GENERATION = re.compile(r"[0-9a-f]{6}")
"""What follows ``<group>-`` in the name of a group of a node group's pods of another image."""
CANCEL_POLL_S = 1.0
"""How often a running ``ShardMigration`` looks whether it was cancelled (an API read)."""


class NotYet(Exception):
    """The step cannot be taken now (the service is not up yet, a drain ran out of time):
    reconcile again in ``delay`` seconds (kopf's temporary error)."""

    def __init__(self, message: str, delay: float = 15.0) -> None:
        super().__init__(message)
        self.delay = delay


class Kube(Protocol):
    """The Kubernetes API as the operator uses it."""

    def get_ray_cluster(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]: ...

    def apply(self, manifest: dict[str, Any]) -> None:
        """Create or update (server-side apply) one manifest, owned by the custom resource."""

    def ensure_token(self, namespace: str, secret: str) -> str:
        """The operator token in Secret ``secret`` (key ``token``), made if missing."""


class Control(Protocol):
    """``db.cluster`` of ``shardflow.connect("grpc://...", token=...)`` (operator role)."""

    def nodes(self) -> list[NodeInfo]: ...

    def migrations(self) -> list[MigrationRecord]: ...

    def migrate(self, shard: str | int, to: str) -> MigrationRecord: ...

    def split(self, shard: str | int) -> MigrationRecord: ...

    def merge(self, first: str | int, second: str | int) -> MigrationRecord: ...

    def drain(self, node: str, deadline: float = ...) -> list[MigrationRecord]: ...

    def drain_host(self, ray_node_id: str, deadline: float = ...) -> list[MigrationRecord]: ...

    def cancel(self, move_id: str) -> MigrationRecord: ...

    def cancel_drain(self, node: str) -> bool: ...


Connect = Callable[[ClusterSpec, str], Control]
"""Dial a cluster's Flight SQL door with the operator token; raises ClusterError while the
service does not answer."""


# -- ShardflowCluster ---------------------------------------------------------------------
def reconcile_cluster(
    body: Mapping[str, Any],
    kube: Kube,
    connect: Connect,
    drain_deadline_s: float = DRAIN_DEADLINE_S,
) -> dict[str, Any]:
    """Bring the cluster to ``body``'s spec; returns the status to patch. A group scaled down
    first drains the pods going away (their shards move live to the others) and only then
    tells KubeRay which pods to delete; a group scaled up gets pods the balancer fills. A
    group whose image changed is replaced (:func:`rollouts`): its pods of the new image
    start as a group of their own, and once they all serve, the pods of the old image are
    drained and deleted, then their group is dropped."""
    spec = cluster_spec(body)
    token = kube.ensure_token(spec.namespace, spec.operator_token_secret)
    found = observed_groups(kube.get_ray_cluster(spec.namespace, spec.name))
    plan = rollouts(spec, found)
    running = {g.name: g.replicas for g in found}
    shrinking = {r.group.name: running[r.group.name] - r.group.replicas for r in plan
                 if running.get(r.group.name, 0) > r.group.replicas}  # fmt: skip
    upgrading = [r for r in plan if r.old]
    control = _dial(spec, token, connect, needed=bool(shrinking) or bool(upgrading))
    to_delete: dict[str, list[str]] = {}
    nodes = control.nodes() if control is not None and (shrinking or upgrading) else []
    if shrinking:
        assert control is not None
        for group, count in shrinking.items():
            pods = kube.list_pods(spec.namespace, group_labels(spec, group))
            going = pods_to_remove(pods, nodes, count)
            _drain_pods(control, going, nodes, drain_deadline_s)
            to_delete[group] = [_name(p) for p in going]
    groups = [r.group for r in plan]
    waiting: list[str] = []
    for rollout in upgrading:
        assert control is not None
        serving = _serving(kube, spec, rollout.group, nodes)
        if serving < rollout.group.replicas:  # the old pods serve on meanwhile
            groups += [replace(rollout.group, name=o.name, image=o.image, replicas=o.replicas)
                       for o in rollout.old]  # fmt: skip
            waiting.append(
                f"{rollout.group.name}: {serving} of {rollout.group.replicas} pods of "
                f"{rollout.group.image} serve"
            )
            continue
        for old in rollout.old:
            pods = kube.list_pods(spec.namespace, group_labels(spec, old.name))
            if not pods and old.replicas == 0:
                continue  # its pods are gone: the group is dropped
            _drain_pods(control, pods, nodes, drain_deadline_s)
            groups.append(replace(rollout.group, name=old.name, image=old.image, replicas=0))
            to_delete[old.name] = sorted(_name(p) for p in pods)
            waiting.append(f"{old.name}: {len(pods)} pods of {old.image} drained, deleted")
    for manifest in render(spec, to_delete, groups):
        kube.apply(manifest)
    scaling = bool(shrinking) or _growing(running, plan)
    return cluster_status(body, spec, control, scaling=scaling, upgrading=waiting)


@dataclass(frozen=True)
class ObservedGroup:
    """A worker group of the RayCluster as it is: its name, its pods' image, replicas."""

    name: str
    image: str
    replicas: int


@dataclass(frozen=True)
class Rollout:
    """A node group as it is rendered: ``group`` (named as KubeRay knows it, with the image
    the spec wants) and the groups of its pods of other images, still to be replaced."""

    group: NodeGroup
    old: tuple[ObservedGroup, ...] = ()


def observed_groups(ray_cluster: Mapping[str, Any] | None) -> list[ObservedGroup]:
    """The worker groups of an observed RayCluster (none: empty)."""
    groups = ((ray_cluster or {}).get("spec") or {}).get("workerGroupSpecs") or []
    found = []
    for group in groups:
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        image = str(containers[0].get("image", ""))
        found.append(ObservedGroup(str(group["groupName"]), image, int(group.get("replicas", 0))))
    return found


def rollouts(spec: ClusterSpec, observed: Sequence[ObservedGroup]) -> list[Rollout]:
    """Each node group of ``spec``, and what runs of it. A group's pods of the wanted image
    keep their KubeRay group; when the image changes, the new pods get a group of their own,
    named ``<group>-<6 hex digits of the image's sha256>`` (the group's own name where it is
    free), and the groups of the group's other images are old.

    >>> from shardflow.k8s.render import cluster_spec
    >>> spec = cluster_spec({"metadata": {"name": "sf", "namespace": "n"}, "spec": {
    ...     "image": "sf:2", "dataDir": {"uri": "file:///d"},
    ...     "nodeGroups": [{"name": "cpu", "replicas": 3}]}})
    >>> [(r.group.name, r.old) for r in rollouts(spec, [ObservedGroup("cpu", "sf:2", 3)])]
    [('cpu', ())]
    >>> (new,) = rollouts(spec, [ObservedGroup("cpu", "sf:1", 3)])
    >>> new.group.name, new.group.image, new.group.replicas, [o.name for o in new.old]
    ('cpu-0074e0', 'sf:2', 3, ['cpu'])
    """
    plan = []
    for group in spec.groups:
        image = group.image or spec.image
        mine = [o for o in observed if o.name == group.name
                or GENERATION.fullmatch(o.name.removeprefix(group.name + "-"))]  # fmt: skip
        # a group whose image is not known (not in its template) is taken to run this one
        current = next((o.name for o in mine if o.image in (image, "")), None)
        if current is None:
            taken = any(o.name == group.name for o in mine)
            digest = hashlib.sha256(image.encode()).hexdigest()[:6]
            current = f"{group.name}-{digest}" if taken else group.name
        old = tuple(o for o in mine if o.name != current)
        plan.append(Rollout(replace(group, name=current, image=image), old))
    return plan


def _drain_pods(
    control: Control,
    pods: Sequence[Mapping[str, Any]],
    nodes: Sequence[NodeInfo],
    deadline_s: float,
) -> None:
    """Move every shard off the pods' workers (live); the pods stay until it is done."""
    for pod in pods:
        for ray_node_id in ray_nodes_of(pod, nodes):
            try:
                control.drain_host(ray_node_id, deadline_s)
            except Error as error:  # the pod stays; the next reconcile goes on
                raise NotYet(f"draining pod {_name(pod)}: {error}", 30.0) from None


def _serving(kube: Kube, spec: ClusterSpec, group: NodeGroup, nodes: Sequence[NodeInfo]) -> int:
    """How many of a group's pods run and have a shardflow worker serving on them."""
    pods = kube.list_pods(spec.namespace, group_labels(spec, group.name))
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    return sum(1 for p in running if ray_nodes_of(p, nodes))


def _dial(spec: ClusterSpec, token: str, connect: Connect, needed: bool) -> Control | None:
    try:
        return connect(spec, token)
    except ClusterError as error:
        if needed:  # a scale-down waits: nothing may go before its shards moved
            raise NotYet(f"the service at {spec.flight_address} does not answer: {error}") from None
        return None  # starting: the manifests are applied all the same


def _growing(running: Mapping[str, int], plan: Sequence[Rollout]) -> bool:
    return any(r.group.replicas > running.get(r.group.name, 0) for r in plan if not r.old)


def group_labels(spec: ClusterSpec, group: str) -> dict[str, str]:
    """The labels KubeRay puts on the pods of a worker group."""
    return {"ray.io/cluster": spec.name, "ray.io/group": group}


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def ray_nodes_of(pod: Mapping[str, Any], nodes: Sequence[NodeInfo]) -> list[str]:
    """The Ray node ids of a pod's workers: the Ray node named as the pod (its
    ``shardflow-name`` label) or at the pod's IP.

    >>> node = NodeInfo(**{**_BLANK, "ray_node_id": "r1", "host": "10.0.0.7"})
    >>> ray_nodes_of({"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.7"}}, [node])
    ['r1']
    """
    name = _name(pod)
    ip = (pod.get("status") or {}).get("podIP")
    return sorted(
        {
            n.ray_node_id
            for n in nodes
            if n.alive and n.ray_node_id and (n.ray_node_name == name or (ip and n.host == ip))
        }
    )


def pods_to_remove(
    pods: Sequence[Mapping[str, Any]], nodes: Sequence[NodeInfo], count: int
) -> list[dict[str, Any]]:
    """The ``count`` pods a scale-down removes: pods not running first (they hold nothing),
    then those whose workers hold the fewest shards (the least to move), the newest first.

    >>> pods = [{"metadata": {"name": n, "creationTimestamp": t}, "status": {"phase": p}}
    ...         for n, t, p in [("a", "1", "Running"), ("b", "2", "Running"),
    ...                         ("c", "3", "Pending")]]
    >>> [p["metadata"]["name"] for p in pods_to_remove(pods, [], 2)]
    ['c', 'b']
    """

    def held(pod: Mapping[str, Any]) -> int:
        ids = set(ray_nodes_of(pod, nodes))
        return sum(n.shards for n in nodes if n.ray_node_id in ids)

    def order(pod: Mapping[str, Any]) -> tuple[bool, int, str, str]:
        running = (pod.get("status") or {}).get("phase") == "Running"
        created = str(pod["metadata"].get("creationTimestamp", ""))
        return (running, held(pod), _negated(created), _negated(_name(pod)))

    return [dict(p) for p in sorted(pods, key=order)[: max(count, 0)]]


def _negated(text: str) -> str:
    """A key that sorts strings in reverse order (newest timestamp first)."""
    return "".join(chr(0x10FFFF - ord(c)) for c in text)


def cluster_status(
    body: Mapping[str, Any],
    spec: ClusterSpec,
    control: Control | None,
    scaling: bool,
    upgrading: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``status`` of a ShardflowCluster: nodes, shards, phase, last rebalance and
    conditions, as the service reports them; ``upgrading``: what a group's replacement by
    pods of another image waits for or did."""
    generation = (body.get("metadata") or {}).get("generation")
    now = _iso(time.time())
    if control is None:
        return {
            "phase": "Starting",
            "observedGeneration": generation,
            "conditions": [_condition("Ready", False, "ServiceUnreachable", now,
                                      f"no answer from {spec.flight_address} yet")],
        }  # fmt: skip
    nodes = control.nodes()
    alive = [n for n in nodes if n.alive]
    balanced = [m for m in control.migrations() if _by_balancer(m)]
    last = max(balanced, key=lambda m: m.started_at, default=None)
    phase = "Running" if len(alive) == len(nodes) else "Degraded"
    if phase == "Running" and (scaling or upgrading):
        phase = "Upgrading" if upgrading else "Scaling"
    ready = phase != "Degraded"
    status = {
        "phase": phase,
        "observedGeneration": generation,
        "nodes": len(alive),
        "shards": sum(n.shards for n in alive),
        "conditions": [
            _condition("Ready", ready, phase, now, f"{len(alive)} of {len(nodes)} nodes serve"),
            _condition("Scaling", scaling, "Replicas" if scaling else "Steady", now, ""),
            _condition(
                "Upgrading",
                bool(upgrading),
                "Image" if upgrading else "Steady",
                now,
                "; ".join(upgrading),
            ),
        ],
    }
    if last is not None:
        status["lastRebalance"] = _iso(last.started_at + last.seconds)
    return status


def _by_balancer(move: MigrationRecord) -> bool:
    return move.reason != "requested" and not move.reason.startswith("drain")


def _condition(kind: str, ok: bool, reason: str, now: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason,
            "message": message, "lastTransitionTime": now}  # fmt: skip


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- ShardMigration -----------------------------------------------------------------------
ACTIONS = ("move", "split", "merge", "drain")


@dataclass(frozen=True)
class MigrationSpec:
    """A checked ``ShardMigration`` spec."""

    action: str
    shard: str | None = None
    to: str | None = None
    other: str | None = None
    drain: str | None = None
    deadline_s: float = DRAIN_DEADLINE_S


def migration_spec(spec: Mapping[str, Any]) -> MigrationSpec:
    """``spec.action`` (``move`` when ``to`` is given, ``drain`` when ``drain`` is) and what
    that action needs; :class:`ConfigError` says what is missing.

    >>> migration_spec({"shard": "t#3", "to": "node-2"}).action
    'move'
    """
    action = spec.get("action") or ("drain" if spec.get("drain") else "move")
    if action not in ACTIONS:
        raise ConfigError(f"spec.action must be one of {ACTIONS}, not {action!r}")
    needs = {"move": ("shard", "to"), "split": ("shard",), "merge": ("shard", "with"),
             "drain": ("drain",)}[action]  # fmt: skip
    missing = [f"spec.{k}" for k in needs if not spec.get(k)]
    if missing:
        raise ConfigError(f"a {action} needs {' and '.join(missing)}")
    return MigrationSpec(
        action=action,
        shard=_text(spec.get("shard")),
        to=_text(spec.get("to")),
        other=_text(spec.get("with")),
        drain=_text(spec.get("drain")),
        deadline_s=float(spec.get("deadlineSeconds", DRAIN_DEADLINE_S)),
    )


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def cancel_asked(resource: Mapping[str, Any] | None) -> bool:
    """Whether a ShardMigration, as the API server has it now, asks its move to stop: it
    is gone (deleted), being deleted, or marked ``spec.cancel: true``.

    >>> cancel_asked({"spec": {"cluster": "sf", "cancel": True}})
    True
    >>> cancel_asked({"spec": {"cluster": "sf"}, "metadata": {"deletionTimestamp": "now"}})
    True
    >>> cancel_asked({"spec": {"cluster": "sf"}, "metadata": {}})
    False
    """
    if resource is None:
        return True
    if (resource.get("metadata") or {}).get("deletionTimestamp"):
        return True
    return bool((resource.get("spec") or {}).get("cancel"))


def carry_out_migration(
    spec: Mapping[str, Any],
    control: Control,
    progress: Callable[[dict[str, Any]], None] = lambda status: None,
    cancelled: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """Do the ShardMigration's move through the service and return its final status;
    ``progress`` gets the status each time the move's phase changes while it runs.
    ``cancelled`` is asked once before anything starts, then at each new phase and every
    :data:`CANCEL_POLL_S`; once it answers True the move is cancelled (``db.cluster.cancel``:
    rolled back where it has not switched yet) or the drain stopped (``cancel_drain``: no
    more moves, the running one rolled back, the node stays); the status then says
    ``cancelled``."""
    wanted = migration_spec(spec)
    started = time.time()
    if cancelled():
        return {"phase": "Failed", "outcome": "cancelled before it started",
                "startedAt": _iso(started), "finishedAt": _iso(time.time())}  # fmt: skip
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["records"] = _perform(wanted, control)
        except Error as error:
            outcome["error"] = error

    worker = threading.Thread(target=run, name="shard-migration", daemon=True)
    worker.start()
    seen: str | None = None
    stopping = False
    next_look = time.monotonic() + CANCEL_POLL_S
    while worker.is_alive():
        worker.join(POLL_S)
        record = _latest(control, wanted, started)
        moved_on = record is not None and record.phase != seen
        if record is not None and moved_on:
            seen = record.phase
            progress(migration_status(wanted, [record], started))
        if not stopping and worker.is_alive() and (moved_on or time.monotonic() >= next_look):
            next_look = time.monotonic() + CANCEL_POLL_S  # and at each phase
            stopping = cancelled() and _stop(wanted, control, record)
    if "error" in outcome:
        error = outcome["error"]
        records = _mine(control, wanted, started)
        if isinstance(error, MigrationError | MoveCancelled) and records:
            status = migration_status(wanted, records if wanted.drain else records[-1:], started)
            if isinstance(error, MoveCancelled):  # a drain's moves made before it stay made
                status.update(phase="rolled_back", outcome=f"cancelled: {error}")
                status["rollbackReason"] = status["outcome"]
            return status
        return {"phase": "Failed", "outcome": f"{type(error).__name__}: {error}",
                "startedAt": _iso(started), "finishedAt": _iso(time.time())}  # fmt: skip
    return migration_status(wanted, outcome["records"], started)


def _stop(wanted: MigrationSpec, control: Control, record: MigrationRecord | None) -> bool:
    """Ask the service to stop the ShardMigration's move or drain; whether it was asked
    (a move not started yet, or not listed yet, is asked at the next look)."""
    if wanted.action == "drain":
        return control.cancel_drain(str(wanted.drain))  # False: not running (yet, or now)
    if record is None or record.phase in ("done", "rolled_back"):
        return False
    try:
        control.cancel(record.move_id)
    except MoveRefusedError:  # past its switch (it ends as it would) or ended meanwhile
        pass
    return True


def _perform(wanted: MigrationSpec, control: Control) -> list[MigrationRecord]:
    if wanted.action == "move":
        return [control.migrate(_shard(wanted.shard), str(wanted.to))]
    if wanted.action == "split":
        return [control.split(_shard(wanted.shard))]
    if wanted.action == "merge":
        return [control.merge(_shard(wanted.shard), _shard(wanted.other))]
    return control.drain(str(wanted.drain), wanted.deadline_s)


def _shard(value: str | None) -> str | int:
    """A shard id (``orders#3``) or a unit id (digits)."""
    text = str(value)
    return int(text) if text.isdigit() else text


def _mine(control: Control, wanted: MigrationSpec, since: float) -> list[MigrationRecord]:
    """The moves the ShardMigration made since ``since``, oldest first."""
    mine = [m for m in control.migrations()
            if m.started_at >= since - 1.0 and _touches(m, wanted)]  # fmt: skip
    return sorted(mine, key=lambda m: m.started_at)


def _latest(control: Control, wanted: MigrationSpec, since: float) -> MigrationRecord | None:
    mine = _mine(control, wanted, since)
    return mine[-1] if mine else None


def _touches(move: MigrationRecord, wanted: MigrationSpec) -> bool:
    if wanted.drain:
        return wanted.drain in move.from_nodes
    shards = {str(wanted.shard), str(wanted.other)}
    return bool(shards & set(move.shards)) or move.move_id in shards


def migration_status(
    wanted: MigrationSpec, records: Sequence[MigrationRecord], started: float
) -> dict[str, Any]:
    """The ``status`` of a ShardMigration from the move records (one; a drain's several)."""
    if not records:  # a drain of a node that held nothing
        return {"phase": "done", "outcome": "done", "moves": 0, "startedAt": _iso(started),
                "finishedAt": _iso(time.time()), "bytes": 0}  # fmt: skip
    last = records[-1]
    finished = last.phase in ("done", "rolled_back")
    status: dict[str, Any] = {
        "phase": last.phase if len(records) == 1 else ("done" if finished else last.phase),
        "outcome": last.outcome,
        "moveId": last.move_id,
        "moves": len(records),
        "shards": sorted({s for r in records for s in r.shards}),
        "from": sorted({n for r in records for n in r.from_nodes}),
        "to": sorted({n for r in records for n in r.to_nodes}),
        "startedAt": _iso(min(r.started_at for r in records)),
        "bytes": sum(r.bytes for r in records),
        "rows": sum(r.rows for r in records),
        "phaseSeconds": {k: round(v, 3) for k, v in last.phase_seconds.items()},
    }
    if finished:
        status["finishedAt"] = _iso(max(r.started_at + r.seconds for r in records))
        status["durationSeconds"] = round(sum(r.seconds for r in records), 3)
    if last.phase == "rolled_back":
        status["rollbackReason"] = last.outcome
    return status


_BLANK: dict[str, Any] = {
    "node_id": "node-0", "alive": True, "vendor": "cpu", "model": "", "engine": "duckdb",
    "memory_bytes": 0, "cores": 1, "capacity": 1.0, "simulated": False, "shards": 0, "rows": 0,
    "bytes": 0, "queries_running": 0, "utilization": None, "busy_fraction": 0.0,
    "memory_used_bytes": 0, "memory_free_bytes": 0, "device_utilization": None,
    "device_memory_used_bytes": None, "device_memory_free_bytes": None, "engine_note": "",
    "calibration": {},
}  # fmt: skip
"""A NodeInfo's fields for examples (docstrings, tests)."""
