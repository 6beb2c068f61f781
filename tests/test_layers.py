"""The import contracts (``pyproject.toml``, checked by ``make lint``) hold the layers, the
rooms of runtime/ and the walls between them. Each wall is broken on purpose here, in a copy
of the package, and the contract that guards it must fail; the copy as it is must pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

BREAKS = {
    "a circle through a type-only import": (
        "runtime/worker/moves.py",
        "import typing\n\nif typing.TYPE_CHECKING:\n"
        "    from shardflow.runtime.worker.node import WorkerNode\n",
        "No circles between sibling modules or packages BROKEN",
    ),
    "Ray in a worker's logic": (
        "runtime/worker/node.py",
        "import ray\n",
        "Ray only in runtime/ray/ and the client's Ray calls BROKEN",
    ),
    "a room importing the room above it": (
        "runtime/query/executor.py",
        "import shardflow.runtime.client.session\n",
        "runtime/: one room per role, imports go down BROKEN",
    ),
    "the in-process twin importing the Ray room": (
        "runtime/inprocess.py",
        "import shardflow.runtime.ray.handles\n",
        "runtime/: one room per role, imports go down BROKEN",
    ),
    "the service reaching into the runtime": (
        "service/main.py",
        "import shardflow.runtime.protocol\n",
        "The service and the operator use the public API only BROKEN",
    ),
    "the planner calling the runtime": (
        "sql/plan.py",
        "import shardflow.runtime.protocol\n",
        "Pure layers never touch Ray BROKEN",
    ),
}


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package and its contracts."""
    shutil.copytree(
        ROOT / "src" / "shardflow",
        tmp_path / "src" / "shardflow",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_as_it_is_keeps_every_contract(tree: Path) -> None:
    done = lint(tree)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " BROKEN" not in done.stdout and "0 broken" in done.stdout
    assert (
        str(tree)
        in subprocess.run(  # the copy is what was checked
            [sys.executable, "-c", "import shardflow; print(shardflow.__file__)"],
            env={"PYTHONPATH": str(tree / "src")},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


@pytest.mark.parametrize("wall", BREAKS)
def test_a_wall_broken_on_purpose_fails_its_contract(tree: Path, wall: str) -> None:
    module, line, broken = BREAKS[wall]
    path = tree / "src" / "shardflow" / module
    path.write_text(path.read_text() + "\n" + line)
    done = lint(tree)
    assert done.returncode != 0, done.stdout
    assert broken in done.stdout, done.stdout
