"""The kopf operator (``shardflow operator``, extra ``shardflow[k8s]``): it watches
``ShardflowCluster`` and ``ShardMigration`` resources and runs :mod:`.handlers` with the API
server (:class:`ApiKube`) and each cluster's Flight SQL door (operator-role token from the
cluster's Secret). Everything it decides is in :mod:`.handlers` and :mod:`.render`."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any, cast

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from shardflow.errors import ConfigError, Error
from shardflow.k8s.handlers import (
    Control,
    NotYet,
    cancel_asked,
    carry_out_migration,
    migration_spec,
    reconcile_cluster,
)
from shardflow.k8s.render import GROUP, MANAGED_BY, VERSION, ClusterSpec, cluster_spec
from shardflow.service.auth import TOKEN_PREFIX

log = logging.getLogger(__name__)
CLUSTERS = "shardflowclusters"
MIGRATIONS = "shardmigrations"
STATUS_INTERVAL_S = 30.0
"""How often a cluster's status (nodes, shards, phase) is read again between changes."""


class ApiKube:
    """:class:`~shardflow.k8s.handlers.Kube` on the API server; what it makes is owned by
    ``owner`` (deleted with it)."""

    def __init__(self, owner: Mapping[str, Any]) -> None:
        self.owner = owner
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.dynamic = DynamicClient(self.api)

    def get_ray_cluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = self.custom.get_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayclusters", name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return cast(dict[str, Any], found)

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return [self.api.sanitize_for_serialization(p) for p in pods.items]

    def apply(self, manifest: dict[str, Any]) -> None:
        kopf.adopt(manifest, owner=self.owner)  # type: ignore[arg-type]
        resource = self.dynamic.resources.get(
            api_version=manifest["apiVersion"], kind=manifest["kind"]
        )
        self.dynamic.server_side_apply(
            resource,
            body=manifest,
            namespace=manifest["metadata"]["namespace"],
            field_manager=MANAGED_BY,
            force_conflicts=True,
        )

    def ensure_token(self, namespace: str, secret: str) -> str:
        import base64

        try:
            found = self.core.read_namespaced_secret(secret, namespace)
            return base64.b64decode((found.data or {})["token"]).decode()
        except ApiException as error:
            if error.status != 404:
                raise
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret, "namespace": namespace},
            "type": "Opaque",
            "stringData": {"token": token},
        }
        kopf.adopt(body, owner=self.owner)  # type: ignore[arg-type]
        self.core.create_namespaced_secret(namespace, body)  # type: ignore[arg-type]
        return token


def dial(spec: ClusterSpec, token: str) -> Control:
    """The cluster's Flight SQL door, as the operator role."""
    import shardflow

    return cast(Control, shardflow.connect(spec.flight_address, token=token).cluster)


def _temporary(error: NotYet) -> kopf.TemporaryError:
    return kopf.TemporaryError(str(error), delay=error.delay)


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.INFO
    try:
        config.load_incluster_config()
    except config.ConfigException:  # run outside the cluster: the kubeconfig's context
        config.load_kube_config()


@kopf.on.resume(GROUP, VERSION, CLUSTERS)
@kopf.on.create(GROUP, VERSION, CLUSTERS)
@kopf.on.update(GROUP, VERSION, CLUSTERS, field="spec")
@kopf.timer(GROUP, VERSION, CLUSTERS, interval=STATUS_INTERVAL_S, idle=STATUS_INTERVAL_S)
def reconcile(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    try:
        status = reconcile_cluster(body, ApiKube(body), dial)
    except NotYet as error:
        raise _temporary(error) from None
    except ConfigError as error:
        raise kopf.PermanentError(str(error)) from None
    patch.status.update(status)


@kopf.on.create(GROUP, VERSION, MIGRATIONS)  # type: ignore[arg-type]
def migrate(
    body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, patch: kopf.Patch, **_: Any
) -> None:
    try:
        migration_spec(spec)
        cluster_body = client.CustomObjectsApi().get_namespaced_custom_object(
            GROUP, VERSION, namespace, CLUSTERS, spec["cluster"]
        )
    except ConfigError as error:
        raise kopf.PermanentError(str(error)) from None
    except ApiException as error:
        found = f"ShardflowCluster {spec['cluster']!r}: {error.reason}"
        raise kopf.TemporaryError(found, delay=30) from None
    owner = cast(dict[str, Any], cluster_body)
    cluster = cluster_spec(owner)
    token = ApiKube(owner).ensure_token(namespace, cluster.operator_token_secret)
    try:
        control = dial(cluster, token)
    except Error as error:
        raise kopf.TemporaryError(f"the service does not answer: {error}", 15) from None

    api = client.CustomObjectsApi()

    def progress(status: dict[str, Any]) -> None:  # the phases, as the move goes
        try:
            api.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, MIGRATIONS, name, {"status": status}
            )
        except ApiException as error:
            if error.status != 404:  # deleted: the move is being cancelled
                raise

    def cancelled() -> bool:  # deleted, being deleted, or spec.cancel set since
        try:
            found = api.get_namespaced_custom_object(GROUP, VERSION, namespace, MIGRATIONS, name)
        except ApiException as error:
            if error.status != 404:
                log.warning("ShardMigration %s/%s not read: %s", namespace, name, error.reason)
                return False
            found = None
        return cancel_asked(cast(dict[str, Any], found) if found is not None else None)

    patch.status.update(carry_out_migration(spec, control, progress, cancelled))


def run(namespaces: list[str], verbose: bool = False) -> None:
    """Run the operator until stopped: in ``namespaces``, or cluster-wide when none."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO)
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces)
