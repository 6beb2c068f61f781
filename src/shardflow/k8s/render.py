"""Desired state: a ``ShardflowCluster`` custom resource in, the KubeRay ``RayCluster`` and
the Service of its Flight SQL door out. Pure functions of plain data (no API calls), so the
operator's output is checked by golden files and schema validation.

>>> body = {"metadata": {"name": "sf", "namespace": "data"},
...         "spec": {"image": "shardflow:0.2.0", "dataDir": {"uri": "file:///data"},
...                  "nodeGroups": [{"name": "cpu", "deviceClass": "cpu", "replicas": 2}]}}
>>> [m["kind"] for m in render(cluster_spec(body))]
['RayCluster', 'Service']
>>> body["spec"]["flightEndpoints"] = "workers"  # answers read straight from the workers
>>> [m["kind"] for m in render(cluster_spec(body))]
['RayCluster', 'Service', 'Service', 'NetworkPolicy']
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from shardflow.config import FLIGHT_ENDPOINTS
from shardflow.errors import ConfigError

GROUP = "shardflow.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RAY_API_VERSION = "ray.io/v1"
RAY_VERSION = "2.60.0"
"""The Ray release of the image (``pyproject.toml`` pins ray 2.60)."""
GPU_RESOURCES = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
"""The extended resource each GPU vendor's device plugin announces."""
DEVICE_CLASSES = ("nvidia", "amd", "cpu")
DATA_NODE_RESOURCE = "shardflow"
"""The Ray resource of nodes that serve shards (the head, control only, lacks it); the same
name as :data:`shardflow.runtime.ray.names.DATA_NODE_RESOURCE`."""
PROCESS_ENVIRONMENT = {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"}
"""Set on the Ray containers: :data:`shardflow.runtime.ray.node.PROCESS_ENVIRONMENT` (Arrow's
allocator, which hands freed memory back to the system)."""
FLIGHT_PORT = 8815
ENDPOINT_PORT = 8816
"""The workers' own Flight port (``spec.endpointPort``), where ``spec.flightEndpoints`` is
``workers``: clients read the parts of answers there."""
OPERATOR_TOKEN_DIR = "/etc/shardflow/operator"
TLS_DIR = "/etc/shardflow/tls"
MANAGED_BY = "shardflow-operator"
BALANCER_SETTINGS = {
    "autoBalance": "auto_balance",
    "intervalSeconds": "balance_interval_s",
    "utilizationThreshold": "utilization_threshold",
    "tolerance": "balance_tolerance",
    "maxConcurrentMoves": "max_concurrent_moves",
    "migrationBandwidthMBps": "migration_bandwidth_mb_s",
    "migrationShare": "migration_share",
}
"""``spec.balancer`` fields and the shardflow settings they set (``shardflow serve --set``)."""


@dataclass(frozen=True)
class NodeGroup:
    """One KubeRay worker group: Ray nodes of one device class."""

    name: str
    device_class: str
    replicas: int
    gpus_per_node: int = 0
    cpu: str = "4"
    memory: str = "16Gi"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    image: str | None = None
    door: bool = False
    """Its pods also serve Flight SQL (replicas of the door behind the one Service)."""


@dataclass(frozen=True)
class BackupSchedule:
    """``spec.backup``: ``shardflow backup`` of the data directory on a schedule, then
    ``shardflow backup prune`` keeping the newest ``keep``."""

    schedule: str
    to: str
    keep: int = 7
    max_rate_mb_s: float = 0.0
    suspend: bool = False
    keep_log: bool = False
    """``--keep-log``: the log kept between backups, for ``shardflow restore --as-of``."""


@dataclass(frozen=True)
class ClusterSpec:
    """A checked ``ShardflowCluster``."""

    name: str
    namespace: str
    image: str
    data_path: str
    volume_claim: str | None
    groups: tuple[NodeGroup, ...]
    flight_port: int = FLIGHT_PORT
    endpoints: str = "service"
    """Where clients read answers that need no final step: through the door, or straight
    from the workers (``workers``: a headless Service and a NetworkPolicy for their port)."""
    endpoint_port: int = ENDPOINT_PORT
    tls_secret: str | None = None
    operator_token_secret: str = ""
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    redis_address: str | None = None
    """The Redis keeping the head's state (``spec.head.faultTolerance``); None: the head's
    loss ends the cluster."""
    redis_password_secret: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    """shardflow settings of ``spec.balancer``, by shardflow's names."""
    backup: BackupSchedule | None = None
    """``spec.backup``: online backups on a schedule (a CronJob), or none."""

    @property
    def flight_service(self) -> str:
        return f"{self.name}-flight"

    @property
    def endpoint_service(self) -> str:
        return f"{self.name}-endpoints"

    @property
    def head_address(self) -> str:
        """The Ray head's GCS as pods other than the head reach it (KubeRay's head Service)."""
        return f"{self.name}-head-svc.{self.namespace}.svc.cluster.local:6379"

    @property
    def flight_address(self) -> str:
        """The Flight SQL door as the operator dials it (inside the cluster)."""
        scheme = "grpc+tls" if self.tls_secret else "grpc"
        host = f"{self.flight_service}.{self.namespace}.svc"
        return f"{scheme}://{host}:{self.flight_port}"


def cluster_spec(body: Mapping[str, Any]) -> ClusterSpec:
    """The checked spec of a ``ShardflowCluster`` body; :class:`ConfigError` says what is
    wrong (the API server's schema check catches most of it before)."""
    metadata = body.get("metadata") or {}
    spec = body.get("spec") or {}
    name = _required(metadata, "name", "metadata.name")
    image = _required(spec, "image", "spec.image")
    data = spec.get("dataDir") or {}
    uri = urlparse(_required(data, "uri", "spec.dataDir.uri"))
    if uri.scheme != "file" or not uri.path.startswith("/") or uri.netloc:
        raise ConfigError(
            f"spec.dataDir.uri must be file:///<absolute path> (shards live on a file system "
            f"every pod mounts, e.g. a ReadWriteMany volume), not {data['uri']!r}"
        )
    groups = tuple(_group(g, i) for i, g in enumerate(spec.get("nodeGroups") or []))
    if not groups:
        raise ConfigError("spec.nodeGroups needs at least one group of data nodes")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ConfigError(f"spec.nodeGroups names must differ: {names}")
    balancer = spec.get("balancer") or {}
    unknown = sorted(set(balancer) - set(BALANCER_SETTINGS))
    if unknown:
        raise ConfigError(f"spec.balancer has unknown fields {unknown}; known: "
                          f"{sorted(BALANCER_SETTINGS)}")  # fmt: skip
    head = spec.get("head") or {}
    endpoints = str(spec.get("flightEndpoints", "service"))
    if endpoints not in FLIGHT_ENDPOINTS:
        raise ConfigError(f"spec.flightEndpoints must be one of {FLIGHT_ENDPOINTS}, not "
                          f"{endpoints!r}")  # fmt: skip
    flight_port = int(spec.get("flightPort", FLIGHT_PORT))
    endpoint_port = int(spec.get("endpointPort", ENDPOINT_PORT))
    if endpoint_port == flight_port:  # a door on a worker's pod listens on flightPort
        raise ConfigError(f"spec.endpointPort must differ from spec.flightPort ({flight_port})")
    return ClusterSpec(
        name=name,
        namespace=str(metadata.get("namespace") or "default"),
        image=image,
        data_path=uri.path,
        volume_claim=data.get("volumeClaim"),
        groups=groups,
        flight_port=flight_port,
        endpoints=endpoints,
        endpoint_port=endpoint_port,
        tls_secret=spec.get("tlsSecret"),
        operator_token_secret=str(spec.get("operatorTokenSecret") or f"{name}-operator-token"),
        head_cpu=str(head.get("cpu", "2")),
        head_memory=str(head.get("memory", "8Gi")),
        redis_address=(head.get("faultTolerance") or {}).get("redisAddress"),
        redis_password_secret=(head.get("faultTolerance") or {}).get("redisPasswordSecret"),
        settings={BALANCER_SETTINGS[k]: v for k, v in sorted(balancer.items())},
        backup=_backup(spec.get("backup")),
    )


def _backup(section: Mapping[str, Any] | None) -> BackupSchedule | None:
    if section is None:
        return None
    schedule = _required(section, "schedule", "spec.backup.schedule")
    to = _required(section, "to", "spec.backup.to")
    keep = section.get("keep", 7)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"spec.backup.keep must be a whole number >= 1, not {keep!r}")
    rate = section.get("maxRateMBps", 0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate < 0:
        raise ConfigError(f"spec.backup.maxRateMBps must be 0 (no cap) or more, not {rate!r}")
    keep_log = section.get("keepLog", False)
    if not isinstance(keep_log, bool):
        raise ConfigError(f"spec.backup.keepLog must be true or false, not {keep_log!r}")
    suspend = bool(section.get("suspend", False))
    return BackupSchedule(schedule, to, keep, float(rate), suspend, keep_log)


def _required(section: Mapping[str, Any], key: str, where: str) -> str:
    value = section.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} is required (a non-empty string)")
    return value


def _group(group: Mapping[str, Any], index: int) -> NodeGroup:
    where = f"spec.nodeGroups[{index}]"
    name = _required(group, "name", f"{where}.name")
    device = str(group.get("deviceClass", "cpu"))
    if device not in DEVICE_CLASSES:
        raise ConfigError(f"{where}.deviceClass must be one of {DEVICE_CLASSES}, not {device!r}")
    replicas = group.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ConfigError(f"{where}.replicas must be a whole number >= 0, not {replicas!r}")
    gpus = group.get("gpusPerNode", 1 if device != "cpu" else 0)
    if device == "cpu" and gpus:
        raise ConfigError(f"{where}: a cpu group has no GPUs (gpusPerNode must be 0)")
    if device != "cpu" and (not isinstance(gpus, int) or gpus < 1):
        raise ConfigError(f"{where}.gpusPerNode must be at least 1 on a {device} group")
    resources = group.get("resources") or {}
    return NodeGroup(
        name=name,
        device_class=device,
        replicas=replicas,
        gpus_per_node=int(gpus),
        cpu=str(resources.get("cpu", "4")),
        memory=str(resources.get("memory", "16Gi")),
        node_selector=dict(group.get("nodeSelector") or {}),
        image=group.get("image"),
        door=bool(group.get("door", False)),
    )


# -- rendering ----------------------------------------------------------------------------
def render(
    spec: ClusterSpec,
    workers_to_delete: Mapping[str, Sequence[str]] | None = None,
    groups: Sequence[NodeGroup] | None = None,
) -> list[dict[str, Any]]:
    """The manifests of ``spec``: its RayCluster, then the Service of its Flight SQL door,
    and where clients read answers from the workers, the headless Service of the workers'
    endpoints and the NetworkPolicy that lets clients reach those and nothing else of the
    data pods. ``workers_to_delete`` (group -> pod names) tells KubeRay which pods a
    scale-down removes (pods whose shards the operator has already moved away). ``groups``:
    the worker groups as KubeRay gets them, where they are not ``spec.groups`` (while a
    group's pods of an older image are replaced, each image is a group of its own)."""
    rendered = spec.groups if groups is None else tuple(groups)
    manifests = [ray_cluster(spec, workers_to_delete or {}, rendered), flight_service(spec)]
    if spec.endpoints == "workers":
        manifests += [endpoint_service(spec), endpoint_policy(spec)]
    if spec.backup is not None:
        manifests.append(backup_job(spec, spec.backup))
    fresh: list[dict[str, Any]] = json.loads(json.dumps(manifests))  # no shared parts: no
    return fresh  # YAML aliases, and a change to one place changes only that place


DOOR_LABEL = "shardflow.io/door"
"""On the pods that serve Flight SQL: the Service's selector."""
DATA_LABEL = "shardflow.io/data-node"
"""On the pods of data nodes (the worker groups): the endpoints' Service and policy select
them."""
RAY_TMP_VOLUME = {"name": "ray-tmp", "emptyDir": {}}
RAY_TMP_MOUNT = {"name": "ray-tmp", "mountPath": "/tmp/ray"}
"""Ray's folder (its raylet's sockets), shared by the Ray container and a door beside it."""


def labels(spec: ClusterSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "shardflow",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def ray_cluster(
    spec: ClusterSpec,
    workers_to_delete: Mapping[str, Sequence[str]],
    groups: Sequence[NodeGroup] | None = None,
) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "authOptions": {"mode": "token"},  # Ray's token authentication stays on
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "127.0.0.1"},
            "template": _head_pod(spec),
        },
        "workerGroupSpecs": [
            _worker_group(spec, g, sorted(workers_to_delete.get(g.name, ())))
            for g in (spec.groups if groups is None else groups)
        ],
    }
    if spec.redis_address:
        cluster["gcsFaultToleranceOptions"] = _fault_tolerance(spec)
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": labels(spec)},
        "spec": cluster,
    }


def _fault_tolerance(spec: ClusterSpec) -> dict[str, Any]:
    """KubeRay's GCS fault tolerance: the head keeps the cluster's state in Redis, under a
    prefix of this cluster's own (several clusters may share one Redis)."""
    options: dict[str, Any] = {
        "redisAddress": spec.redis_address,
        "externalStorageNamespace": f"{spec.namespace}-{spec.name}",
    }
    if spec.redis_password_secret:
        secret = {"name": spec.redis_password_secret, "key": "password"}
        options["redisPassword"] = {"valueFrom": {"secretKeyRef": secret}}
    return options


def flight_service(spec: ClusterSpec) -> dict[str, Any]:
    """The cluster-internal door to Flight SQL: every pod that serves it (the head, and the
    pods of groups with ``door``), behind one address (Ray's own ports get none)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": spec.flight_service,
            "namespace": spec.namespace,
            "labels": labels(spec),
        },
        "spec": {
            "type": "ClusterIP",
            "selector": {"ray.io/cluster": spec.name, DOOR_LABEL: "true"},
            "ports": [{"name": "flight", "port": spec.flight_port, "targetPort": spec.flight_port}],
        },
    }


def endpoint_service(spec: ClusterSpec) -> dict[str, Any]:
    """A headless Service over the data pods' endpoint port: no address of its own, a DNS
    name that lists the pods (``<name>-endpoints.<namespace>.svc``). A client is handed each
    worker's own address in the answer's endpoints; the Service names the port for the
    policy and lets a client or a mesh find the workers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": spec.endpoint_service,
            "namespace": spec.namespace,
            "labels": labels(spec),
        },
        "spec": {
            "clusterIP": "None",
            "selector": _data_pods(spec),
            "ports": [
                {"name": "endpoint", "port": spec.endpoint_port, "targetPort": spec.endpoint_port}
            ],
        },
    }


def endpoint_policy(spec: ClusterSpec) -> dict[str, Any]:
    """What reaches the data pods: the cluster's own pods, on any port (Ray, the fast
    lanes, moves), and any other pod only on the endpoint port (the parts of answers, each
    read with a ticket the worker checks) and, on pods that are doors too, the Flight SQL
    port. Ray's ports, which run code for whoever reaches them, stay inside the cluster."""
    ports = [{"protocol": "TCP", "port": spec.endpoint_port}]
    if any(group.door for group in spec.groups):
        ports.append({"protocol": "TCP", "port": spec.flight_port})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": spec.endpoint_service,
            "namespace": spec.namespace,
            "labels": labels(spec),
        },
        "spec": {
            "podSelector": {"matchLabels": _data_pods(spec)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": spec.name}}}]},
                {"ports": ports},
            ],
        },
    }


def _data_pods(spec: ClusterSpec) -> dict[str, str]:
    """The labels of the cluster's data pods (the worker groups')."""
    return {"ray.io/cluster": spec.name, DATA_LABEL: "true"}


def serve_command(spec: ClusterSpec, address: str = "127.0.0.1:6379") -> list[str]:
    """``shardflow serve`` beside a Ray node: on the head pod attached to the head beside
    it, on a door pod to the head through its Service (a driver on its own pod's raylet)."""
    command = [
        "shardflow", "serve", "--address", address, "--data-dir", spec.data_path,
        "--flight-port", str(spec.flight_port), "--host", "0.0.0.0",
        "--operator-token-file", f"{OPERATOR_TOKEN_DIR}/token",
    ]  # fmt: skip
    if spec.tls_secret:
        command += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
    else:  # inside the cluster network only (a ClusterIP Service); docs say when to add TLS
        command += ["--insecure"]
    settings = dict(spec.settings)
    if spec.endpoints == "workers":
        settings.update(flight_endpoints="workers", endpoint_port=spec.endpoint_port)
    for name, value in settings.items():  # as shardflow serve reads them: text as it is
        command += ["--set", f"{name}={value if isinstance(value, str) else json.dumps(value)}"]
    return command


def backup_job(spec: ClusterSpec, backup: BackupSchedule) -> dict[str, Any]:
    """The CronJob of ``spec.backup``: a pod with the data volume runs ``shardflow backup``
    (online: the cluster serves on; it writes only the data directory's ``holds/``), then
    ``shardflow backup prune``; never two at once (a backup and a prune refuse each other
    anyway)."""
    volumes, mounts = _data_volume(spec)
    data_dir = spec.data_path
    rate = f"{backup.max_rate_mb_s:g}"
    script = (
        f"shardflow backup --data-dir {shlex.quote(data_dir)} --to {shlex.quote(backup.to)} "
        f"--max-rate-mb-s {rate}{' --keep-log' if backup.keep_log else ''} && "
        f"shardflow backup prune {shlex.quote(backup.to)} --keep {backup.keep}"
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {
            "name": f"{spec.name}-backup",
            "namespace": spec.namespace,
            "labels": labels(spec),
        },
        "spec": {
            "schedule": backup.schedule,
            "suspend": backup.suspend,
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {
                "spec": {
                    "backoffLimit": 2,
                    "template": {
                        "metadata": {"labels": labels(spec)},
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {
                                    "name": "shardflow-backup",
                                    "image": spec.image,
                                    "command": ["sh", "-c", script],
                                    "env": _environment(),
                                    "volumeMounts": mounts,
                                }
                            ],
                            "volumes": volumes,
                        },
                    },
                }
            },
        },
    }


def _environment() -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in sorted(PROCESS_ENVIRONMENT.items())]


def _data_volume(spec: ClusterSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if spec.volume_claim is None:
        return [], []
    volume = {"name": "data", "persistentVolumeClaim": {"claimName": spec.volume_claim}}
    return [volume], [{"name": "data", "mountPath": spec.data_path}]


def _door(
    spec: ClusterSpec, image: str, address: str, mounts: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``shardflow serve`` container of a pod that serves Flight SQL (restarted by the
    kubelet until the Ray node beside it answers), and the volumes it adds to the pod: the
    operator's token, the TLS certificate, and Ray's folder shared with the Ray container
    (a driver reaches its raylet through the sockets there)."""
    volumes = [
        {"name": "operator-token", "secret": {"secretName": spec.operator_token_secret}},
    ]
    token = {"name": "operator-token", "mountPath": OPERATOR_TOKEN_DIR, "readOnly": True}
    serve_mounts = [*mounts, RAY_TMP_MOUNT, token]
    if spec.tls_secret:
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls_secret}})
        serve_mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    container = {
        "name": "shardflow-serve",
        "image": image,
        "command": serve_command(spec, address),
        "ports": [{"name": "flight", "containerPort": spec.flight_port}],
        "readinessProbe": {"tcpSocket": {"port": spec.flight_port}, "periodSeconds": 5},
        "volumeMounts": serve_mounts,
    }
    return container, [RAY_TMP_VOLUME, *volumes]


def _head_pod(spec: ClusterSpec) -> dict[str, Any]:
    volumes, mounts = _data_volume(spec)
    door, door_volumes = _door(spec, spec.image, "127.0.0.1:6379", mounts)
    resources = {"cpu": spec.head_cpu, "memory": spec.head_memory}
    return {
        "metadata": {"labels": {**labels(spec), DOOR_LABEL: "true"}},
        "spec": {
            "containers": [
                {
                    "name": "ray-head",
                    "image": spec.image,
                    "resources": {"requests": resources, "limits": resources},
                    "env": _environment(),
                    "volumeMounts": [*mounts, RAY_TMP_MOUNT],
                },
                door,
            ],
            "volumes": [*volumes, *door_volumes],
        },
    }


def _worker_group(spec: ClusterSpec, group: NodeGroup, to_delete: list[str]) -> dict[str, Any]:
    volumes, mounts = _data_volume(spec)
    requests: dict[str, str] = {"cpu": group.cpu, "memory": group.memory}
    limits = dict(requests)
    params: dict[str, str] = {}
    pod: dict[str, Any] = {}
    gpu = GPU_RESOURCES.get(group.device_class)
    if gpu is not None:
        limits[gpu] = str(group.gpus_per_node)
        params["num-gpus"] = str(group.gpus_per_node)  # KubeRay infers NVIDIA's only
        pod["tolerations"] = [{"key": gpu, "operator": "Exists", "effect": "NoSchedule"}]
    if group.node_selector:
        pod["nodeSelector"] = dict(group.node_selector)
    image = group.image or spec.image
    containers: list[dict[str, Any]] = [
        {
            "name": "ray-worker",
            "image": image,
            "resources": {"requests": requests, "limits": limits},
            "env": _environment(),
            "volumeMounts": mounts,
        }
    ]
    if spec.endpoints == "workers":  # the worker's own Flight endpoint
        containers[0]["ports"] = [{"name": "endpoint", "containerPort": spec.endpoint_port}]
    pod_labels = {
        **labels(spec),
        "shardflow.io/device-class": group.device_class,
        DATA_LABEL: "true",
    }
    if group.door:  # a replica of the Flight SQL door on every pod of the group
        door, door_volumes = _door(spec, image, spec.head_address, mounts)
        containers[0]["volumeMounts"] = [*mounts, RAY_TMP_MOUNT]
        containers.append(door)
        volumes = [*volumes, *door_volumes]
        pod_labels[DOOR_LABEL] = "true"
    worker = {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": 0,
        "maxReplicas": max(group.replicas, 1) * 4,
        "rayStartParams": params,
        "resources": {DATA_NODE_RESOURCE: "1"},
        "labels": {"shardflow.io/device-class": group.device_class},
        "template": {
            "metadata": {"labels": pod_labels},
            "spec": {"containers": containers, "volumes": volumes, **pod},
        },
    }
    if to_delete:
        worker["scaleStrategy"] = {"workersToDelete": to_delete}
    return worker
