"""The kopf wiring: the operator watches exactly the resources our CRDs define, and the
command that runs it is there (it cannot run here: no API server)."""

from __future__ import annotations

import subprocess
import sys

import kopf

from shardflow.k8s import operator
from tests.k8s.manifests import DEPLOY, documents


def test_the_operator_handles_the_resources_the_crds_define() -> None:
    crds = {documents(p)[0]["spec"]["names"]["plural"]: documents(p)[0]
            for p in sorted((DEPLOY / "crds").glob("*.yaml"))}  # fmt: skip
    registry = kopf.get_default_registry()
    handled: dict[str, set[str]] = {}
    for handler in registry._changing.get_all_handlers():
        selector = handler.selector
        assert selector is not None
        assert (selector.group, selector.version) == ("shardflow.io", "v1alpha1")
        handled.setdefault(str(selector.any_name), set()).add(handler.id.split("/")[0])
    assert set(handled) == set(crds) == {operator.CLUSTERS, operator.MIGRATIONS}
    assert handled == {"shardflowclusters": {"reconcile"}, "shardmigrations": {"migrate"}}


def test_the_operator_command_is_documented() -> None:
    done = subprocess.run([sys.executable, "-m", "shardflow.cli", "operator", "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "--namespace" in done.stdout and "k8s" in done.stdout


def test_the_docstring_examples_of_rendering_and_handlers_run() -> None:
    import doctest

    from shardflow.k8s import handlers, render

    for module in (render, handlers):
        assert doctest.testmod(module).failed == 0, module.__name__
        assert doctest.testmod(module).attempted > 0, module.__name__
