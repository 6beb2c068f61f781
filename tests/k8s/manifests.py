"""The manifests under ``deploy/k8s`` and the schemas they are checked against: Kubernetes'
own (``kubernetes-validate``, offline, one pinned version), KubeRay's RayCluster CRD (from
``../shared/k8s-schemas``), and our CRDs' OpenAPI schemas (``jsonschema``) with their CEL
validation rules (``cel-python``, evaluated as the API server would)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.35.0"
"""The Kubernetes release whose OpenAPI schemas every built-in manifest must satisfy."""
SCHEMAS_ENV = "SHARDFLOW_K8S_SCHEMAS"
OURS = {"ShardflowCluster", "ShardMigration"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def validate_builtin(manifest: dict[str, Any]) -> None:
    """Kubernetes' schema for a built-in kind (strict: unknown fields are errors)."""
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of our CRD for ``kind``."""
    for path in sorted((DEPLOY / "crds").glob("*.yaml")):
        for crd in documents(path):
            if crd["spec"]["names"]["kind"] == kind:
                schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
                return schema
    raise AssertionError(f"no CRD for {kind}")


def validate_ours(manifest: dict[str, Any]) -> None:
    jsonschema.validate(manifest, crd_schema(manifest["kind"]))


def validate_status(kind: str, status: dict[str, Any]) -> None:
    """A status the operator patches, against the CRD's status schema."""
    jsonschema.validate(status, crd_schema(kind)["properties"]["status"])


def kuberay_schema(required: bool = True) -> dict[str, Any] | None:
    """KubeRay's RayCluster ray.io/v1 schema (``$SHARDFLOW_K8S_SCHEMAS`` or
    ``../shared/k8s-schemas`` beside the repository). Missing: the test is skipped, or
    None when not ``required`` (a test with more to check than the schema goes on)."""
    root = Path(os.environ.get(SCHEMAS_ENV) or REPO.parent / "shared" / "k8s-schemas")
    path = root / "kuberay" / "ray.io_rayclusters.yaml"
    if not path.exists():
        if not required:
            return None
        pytest.skip(f"KubeRay's RayCluster CRD is not at {path} (set ${SCHEMAS_ENV})")
    crd = documents(path)[0]
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def validate_ray_cluster(manifest: dict[str, Any], required: bool = True) -> None:
    """A RayCluster against KubeRay's CRD (where it is; see :func:`kuberay_schema`); each
    pod template also as a Kubernetes Pod."""
    schema = kuberay_schema(required)
    if schema is not None:
        jsonschema.validate(manifest, schema)
    spec = manifest["spec"]
    templates = [spec["headGroupSpec"]["template"]]
    templates += [g["template"] for g in spec.get("workerGroupSpecs", [])]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **template}
        pod["metadata"] = {"name": "p", **template.get("metadata", {})}
        validate_builtin(pod)


def broken_rules(manifest: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """The messages of our CRD's CEL rules (``x-kubernetes-validations``) that ``manifest``
    breaks: created (``old`` None; rules that read ``oldSelf`` are not run then, as the API
    server does) or as an update of ``old``."""
    limit = sys.getrecursionlimit()
    env = celpy.Environment()  # it raises the process's recursion limit to 2,500
    sys.setrecursionlimit(limit)  # which other tests rely on (deep SQL is refused at 1,000)
    broken: list[str] = []

    def walk(schema: dict[str, Any], new: Any, was: Any) -> None:
        if new is None:
            return
        for rule in schema.get("x-kubernetes-validations", []):
            transition = "oldSelf" in rule["rule"]
            if transition and was is None:
                continue
            names = {"self": celpy.json_to_cel(new)}
            if transition:
                names["oldSelf"] = celpy.json_to_cel(was)
            if not env.program(env.compile(rule["rule"])).evaluate(names):
                broken.append(rule.get("message", rule["rule"]))
        for name, sub in schema.get("properties", {}).items():
            if isinstance(new, dict):
                walk(sub, new.get(name), was.get(name) if isinstance(was, dict) else None)

    walk(crd_schema(manifest["kind"]), manifest, old)
    return broken
