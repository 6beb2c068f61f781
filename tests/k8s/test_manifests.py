"""Every manifest of ``deploy/k8s`` and every rendered RayCluster is checked against the
schemas a real API server would use; the rendering has golden files. No API server runs here
(docs/kubernetes.md says what was and was not run against a real cluster)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shardflow.config import Settings
from shardflow.control.migration import Phase
from shardflow.errors import ConfigError
from shardflow.k8s.render import PROCESS_ENVIRONMENT, cluster_spec, render
from shardflow.runtime.ray import node as raynode
from tests.k8s.manifests import (
    DEPLOY,
    OURS,
    REPO,
    broken_rules,
    crd_schema,
    deploy_files,
    documents,
    validate_builtin,
    validate_ours,
    validate_ray_cluster,
)

SAMPLE = DEPLOY / "samples" / "shardflowcluster.yaml"
GOLDEN = REPO / "tests" / "golden" / "k8s"


def sample() -> dict[str, Any]:
    return documents(SAMPLE)[0]


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid(path: Path) -> None:
    for manifest in documents(path):
        if manifest["kind"] in OURS:
            validate_ours(manifest)
            assert broken_rules(manifest) == []
        else:
            validate_builtin(manifest)


def test_the_kustomization_installs_every_manifest_but_the_example_migration() -> None:
    listed = {DEPLOY / r for r in documents(DEPLOY / "kustomization.yaml")[0]["resources"]}
    assert all(p.exists() for p in listed), sorted(p for p in listed if not p.exists())
    assert set(deploy_files()) - listed == {DEPLOY / "samples" / "shardmigration.yaml"}
    if shutil.which("kubectl"):  # where kubectl is installed, its own kustomize agrees
        out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True,
                             text=True, check=True, timeout=60).stdout  # fmt: skip
        assert len([d for d in yaml.safe_load_all(out) if d]) == len(listed)


def test_the_crds_carry_printer_columns_and_a_status_subresource() -> None:
    for path in sorted((DEPLOY / "crds").glob("*.yaml")):
        crd = documents(path)[0]
        assert crd["spec"]["group"] == "shardflow.io"
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
        assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Phase", "Age"}


def test_the_migration_phases_are_the_state_machines() -> None:
    phases = crd_schema("ShardMigration")["properties"]["status"]["properties"]["phase"]
    assert phases["enum"] == [p.value for p in Phase] + ["Failed"]


def test_a_shard_migration_can_be_cancelled_and_changed_in_no_other_way() -> None:
    """Our CRD's CEL rules, run as the API server runs them on create and on update."""
    move = documents(DEPLOY / "samples" / "shardmigration.yaml")[0]
    assert broken_rules(move) == []
    validate_ours(move)

    def update(change: Any) -> list[str]:
        new = copy.deepcopy(move)
        change(new["spec"])
        validate_ours(new)
        return broken_rules(new, move)

    assert update(lambda spec: spec.update(cancel=True)) == []
    assert update(lambda spec: None) == []
    changed = "a ShardMigration cannot be changed but to cancel it; create another"
    assert update(lambda spec: spec.update(to="node-3", cancel=True)) == [changed]
    assert update(lambda spec: spec.update(deadlineSeconds=5)) == [changed]
    assert update(lambda spec: spec.pop("to")) == [changed, "a move needs shard and to"]
    cancelled = copy.deepcopy(move)
    cancelled["spec"]["cancel"] = True
    undone = copy.deepcopy(cancelled)
    undone["spec"]["cancel"] = False
    assert broken_rules(undone, cancelled) == ["a cancelled ShardMigration stays cancelled"]
    merge = {**move, "spec": {"cluster": "sf", "action": "merge", "shard": "t#1"}}
    assert broken_rules(merge) == ["a merge needs shard and with"]


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["spec"].pop("image"),
        lambda s: s["spec"]["nodeGroups"][0].update(deviceClass="tpu"),
        lambda s: s["spec"]["nodeGroups"][0].update(replicas=-1),
        lambda s: s["spec"]["dataDir"].update(uri="s3://bucket/data"),
        lambda s: s["spec"]["balancer"].update(maxConcurrentMoves=0),
        lambda s: s["spec"].update(nodeGroups=[]),
    ],
    ids=["no-image", "unknown-device", "negative-replicas", "not-uri", "no-moves", "no-groups"],
)  # fmt: skip
def test_a_bad_cluster_is_refused_by_the_crd_schema(change: Any) -> None:
    bad = copy.deepcopy(sample())
    change(bad)
    with pytest.raises(jsonschema.ValidationError):
        validate_ours(bad)


def test_a_bad_built_in_manifest_is_refused() -> None:
    role = documents(DEPLOY / "rbac" / "operator-clusterrole.yaml")[0]
    role["rules"][0]["verb"] = ["get"]  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(role)


# -- rendering ----------------------------------------------------------------------------
def test_the_rendered_cluster_is_a_valid_raycluster_and_service() -> None:
    ray_cluster, service, *_ = render(cluster_spec(sample()), {"cpu": ["analytics-cpu-worker-x"]})
    validate_ray_cluster(ray_cluster)
    validate_builtin(service)
    groups = {g["groupName"]: g for g in ray_cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"h200", "mi300", "cpu"}
    assert groups["cpu"]["scaleStrategy"] == {"workersToDelete": ["analytics-cpu-worker-x"]}
    limits = {n: g["template"]["spec"]["containers"][0]["resources"]["limits"]
              for n, g in groups.items()}  # fmt: skip
    assert limits["h200"]["nvidia.com/gpu"] == "1" and limits["mi300"]["amd.com/gpu"] == "1"
    assert not {"nvidia.com/gpu", "amd.com/gpu"} & set(limits["cpu"])


def test_the_ray_containers_start_with_the_environment_of_shardflows_own_nodes() -> None:
    """Arrow's allocator is read from the environment when a process starts: the pods'
    Ray processes get what ``shardflow cluster up`` and embedded clusters give theirs."""
    assert PROCESS_ENVIRONMENT == raynode.PROCESS_ENVIRONMENT
    ray_cluster, *_ = render(cluster_spec(sample()))
    pods = [ray_cluster["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in ray_cluster["spec"]["workerGroupSpecs"]
    ]
    for pod in pods:
        ray = pod["spec"]["containers"][0]
        assert ray["name"].startswith("ray-")
        assert {e["name"]: e["value"] for e in ray["env"]} == PROCESS_ENVIRONMENT


def test_a_broken_render_fails_the_kuberay_schema() -> None:
    ray_cluster, *_ = render(cluster_spec(sample()))
    ray_cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_ray_cluster(ray_cluster)
    ray_cluster, *_ = render(cluster_spec(sample()))
    del ray_cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"]
    ray_cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imag"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_ray_cluster(ray_cluster)


def test_the_head_serves_flight_sql_with_the_operator_token_and_balancer_settings() -> None:
    ray_cluster, service, *_ = render(cluster_spec(sample()))
    head = ray_cluster["spec"]["headGroupSpec"]
    serve = next(
        c for c in head["template"]["spec"]["containers"] if c["name"] == "shardflow-serve"
    )
    command = serve["command"]
    assert command[:3] == ["shardflow", "serve", "--address"]
    assert "--operator-token-file" in command and "--insecure" in command
    assert "migration_bandwidth_mb_s=500" in command and "auto_balance=true" in command
    sets = [command[i + 1] for i, arg in enumerate(command) if arg == "--set"]
    settings = Settings().with_text(sets)  # as shardflow serve reads them
    assert settings.migration_bandwidth_mb_s == 500 and settings.balance_interval_s == 5
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head holds no shards
    tolerance = ray_cluster["spec"]["gcsFaultToleranceOptions"]  # the head survives its loss
    assert tolerance["redisAddress"] == "analytics-redis.analytics.svc:6379"
    assert tolerance["externalStorageNamespace"] == "analytics-analytics"
    assert tolerance["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "analytics-redis"
    groups = {g["groupName"]: g for g in ray_cluster["spec"]["workerGroupSpecs"]}
    door_pod = groups["cpu"]["template"]  # door: true, a replica of Flight SQL on each pod
    assert door_pod["metadata"]["labels"]["shardflow.io/door"] == "true"
    replica = door_pod["spec"]["containers"][1]
    assert replica["name"] == "shardflow-serve"
    assert replica["command"][3] == "analytics-head-svc.analytics.svc.cluster.local:6379"
    shared = {"name": "ray-tmp", "mountPath": "/tmp/ray"}  # its driver finds the raylet
    assert all(shared in c["volumeMounts"] for c in door_pod["spec"]["containers"])
    assert len(groups["h200"]["template"]["spec"]["containers"]) == 1  # no door there
    assert "shardflow.io/door" not in groups["h200"]["template"]["metadata"]["labels"]
    assert head["template"]["metadata"]["labels"]["shardflow.io/door"] == "true"
    assert service["spec"]["selector"] == {"ray.io/cluster": "analytics",
                                           "shardflow.io/door": "true"}  # fmt: skip
    plain = copy.deepcopy(sample())
    del plain["spec"]["head"]["faultTolerance"]
    assert "gcsFaultToleranceOptions" not in render(cluster_spec(plain))[0]["spec"]
    assert service["spec"]["ports"][0]["port"] == 8815
    with_tls = copy.deepcopy(sample())
    with_tls["spec"]["tlsSecret"] = "analytics-tls"
    spec = cluster_spec(with_tls)
    assert spec.flight_address == "grpc+tls://analytics-flight.analytics.svc:8815"
    serve = render(spec)[0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    assert "--insecure" not in serve["command"] and "--tls-cert" in serve["command"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["spec"]["dataDir"].update(uri="s3://b/d"), "file:///"),
        (lambda s: s["spec"]["nodeGroups"].append({"name": "cpu", "deviceClass": "cpu",
                                                   "replicas": 1}), "must differ"),
        (lambda s: s["spec"]["nodeGroups"][2].update(gpusPerNode=2), "no GPUs"),
        (lambda s: s["spec"]["balancer"].update(speed=2), "unknown fields"),
        (lambda s: s["spec"]["nodeGroups"][0].update(deviceClass="tpu"), "deviceClass"),
    ],
    ids=["uri", "duplicate-group", "cpu-gpus", "balancer", "device"],
)  # fmt: skip
def test_rendering_refuses_a_bad_spec_with_a_clear_error(change: Any, message: str) -> None:
    bad = copy.deepcopy(sample())
    change(bad)
    with pytest.raises(ConfigError, match=message):
        cluster_spec(bad)


def test_rendering_matches_the_golden_files() -> None:
    for path in sorted((DEPLOY / "samples").glob("shardflowcluster*.yaml")):
        rendered = yaml.safe_dump_all(render(cluster_spec(documents(path)[0])), sort_keys=True)
        golden = GOLDEN / path.name.replace("shardflowcluster", "rendered")
        if os.environ.get("SHARDFLOW_UPDATE_GOLDEN") == "1":
            golden.write_text(rendered)
        assert golden.exists(), f"no golden file {golden.name}; run with SHARDFLOW_UPDATE_GOLDEN=1"
        assert rendered == golden.read_text(), f"{golden.name} differs from the rendering"


def test_the_rbac_roles_grant_what_they_say() -> None:
    def rules(name: str) -> list[dict[str, Any]]:
        return list(documents(DEPLOY / "rbac" / f"{name}.yaml")[0]["rules"])

    assert rules("migrator-clusterrole") == [
        {
            "apiGroups": ["shardflow.io"],
            "resources": ["shardmigrations"],
            "verbs": ["create", "get", "patch", "delete"],  # patch, delete: to cancel
        }
    ]
    writes = {"create", "update", "patch", "delete", "deletecollection", "*"}
    assert all(not writes & set(r["verbs"]) for r in rules("viewer-clusterrole"))
    operator = rules("operator-clusterrole")
    assert all("*" not in r["verbs"] + r["resources"] + r["apiGroups"] for r in operator)
    assert not any("delete" in r["verbs"] for r in operator)  # KubeRay deletes the pods


def test_workers_endpoints_get_a_headless_service_and_a_policy_that_opens_only_their_port() -> None:
    """``spec.flightEndpoints: workers``: the workers serve their parts of answers on a
    fixed port (a setting the door passes on), a headless Service lists the data pods on
    it, and the NetworkPolicy lets other pods reach the data pods on that port (and the
    door's, on door pods) only; the cluster's own pods reach them on any (Ray, lanes)."""
    ray_cluster, door, endpoints, policy, _ = render(cluster_spec(sample()))
    for manifest in (door, endpoints, policy):
        validate_builtin(manifest)
    validate_ray_cluster(ray_cluster)
    assert endpoints["spec"]["clusterIP"] == "None"
    data = {"ray.io/cluster": "analytics", "shardflow.io/data-node": "true"}
    assert endpoints["spec"]["selector"] == data
    assert endpoints["spec"]["ports"] == [{"name": "endpoint", "port": 8816, "targetPort": 8816}]
    assert policy["spec"]["podSelector"] == {"matchLabels": data}
    inside, outside = policy["spec"]["ingress"]
    assert inside == {"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": "analytics"}}}]}
    assert outside == {"ports": [{"protocol": "TCP", "port": 8816},  # the parts of answers
                                 {"protocol": "TCP", "port": 8815}]}  # fmt: skip # door pods
    for group in ray_cluster["spec"]["workerGroupSpecs"]:
        pod = group["template"]
        assert pod["metadata"]["labels"]["shardflow.io/data-node"] == "true"
        worker = pod["spec"]["containers"][0]
        assert worker["ports"] == [{"name": "endpoint", "containerPort": 8816}]
    head = ray_cluster["spec"]["headGroupSpec"]["template"]
    assert "shardflow.io/data-node" not in head["metadata"]["labels"]  # the head holds none
    serve = head["spec"]["containers"][1]["command"]
    sets = [serve[i + 1] for i, arg in enumerate(serve) if arg == "--set"]
    settings = Settings().with_text(sets)  # as shardflow serve reads them
    assert settings.flight_endpoints == "workers" and settings.endpoint_port == 8816
    through_door = copy.deepcopy(sample())
    del through_door["spec"]["flightEndpoints"]
    kinds = [m["kind"] for m in render(cluster_spec(through_door))]
    assert kinds == ["RayCluster", "Service", "CronJob"]
    clash = copy.deepcopy(sample())
    clash["spec"]["endpointPort"] = 8815
    assert broken_rules(clash) == ["endpointPort must differ from flightPort"]
    with pytest.raises(ConfigError, match="endpointPort must differ"):
        cluster_spec(clash)
    clash["spec"]["flightEndpoints"] = "both"
    with pytest.raises(jsonschema.ValidationError):
        validate_ours(clash)


def test_scheduled_backups_are_a_valid_cronjob_that_backs_up_then_prunes() -> None:
    *_, job = render(cluster_spec(sample()))
    validate_builtin(job)
    assert job["kind"] == "CronJob" and job["metadata"]["name"] == "analytics-backup"
    spec = job["spec"]
    assert spec["schedule"] == "0 3 * * *" and spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["sh", "-c"]
    assert container["command"][2] == (
        "shardflow backup --data-dir /var/lib/shardflow --to s3://analytics-backups/shardflow "
        "--max-rate-mb-s 0 && shardflow backup prune s3://analytics-backups/shardflow --keep 7"
    )
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/var/lib/shardflow"}]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "shardflow-data"}
    odd = copy.deepcopy(sample())
    odd["spec"]["backup"].update(
        to="/backups/it's here", suspend=True, maxRateMBps=300, keepLog=True
    )
    validate_ours(odd)
    *_, job = render(cluster_spec(odd))
    script = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--to '/backups/it'\"'\"'s here' --max-rate-mb-s 300 --keep-log &&" in script[2]
    assert job["spec"]["suspend"] is True
    for change, message in (
        ({"keep": 0}, "keep"),
        ({"maxRateMBps": -1}, "maxRateMBps"),
        ({"keepLog": "yes"}, "keepLog"),
        ({"schedule": ""}, "schedule"),
    ):
        bad = copy.deepcopy(sample())
        bad["spec"]["backup"].update(change)
        with pytest.raises(ConfigError, match=message):
            cluster_spec(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate_ours(bad)
    plain = copy.deepcopy(sample())
    del plain["spec"]["backup"]
    assert "CronJob" not in [m["kind"] for m in render(cluster_spec(plain))]
