"""The release before this code, taken from the repository's own history and installed into
a virtual environment of its own, for the rolling-upgrade test.

The release is the newest ``## X.Y.Z`` heading of CHANGELOG.md; its commit is the tag
``vX.Y.Z`` where the checkout has tags, else the commit that set ``version = "X.Y.Z"`` in
pyproject.toml. Its code is installed as ``pip install -e`` would (a path and the
distribution's metadata); its dependencies are this environment's, which it must pin alike
(checked: a release that pins others is refused here, not half-installed)."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADING = re.compile(r"^## (\d+\.\d+\.\d+)\b", re.MULTILINE)


class NoRelease(Exception):
    """This checkout cannot give the release before (no history, no release yet)."""


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    python: Path
    """The interpreter of its virtual environment."""


def previous_release(root: Path = ROOT) -> tuple[str, str]:
    """The newest release in CHANGELOG.md and its commit."""
    found = HEADING.search((root / "CHANGELOG.md").read_text())
    if found is None:
        raise NoRelease("CHANGELOG.md names no release")
    version = found.group(1)
    tag = _git(root, "rev-parse", "-q", "--verify", f"refs/tags/v{version}^{{commit}}")
    if tag:
        return version, tag
    setting = f'version = "{version}"'
    commits = _git(root, "log", "--format=%H", "-S", setting, "--", "pyproject.toml").split()
    if not commits:
        raise NoRelease(
            f"release {version}: no tag v{version} and no commit that set it in pyproject.toml "
            "(a shallow checkout? `git fetch --unshallow --tags`)"
        )
    return version, commits[-1]  # the oldest: the one that set it


def install(version: str, commit: str, folder: Path, root: Path = ROOT) -> Release:
    """Install the release at ``commit`` into a virtual environment under ``folder``."""
    tree = folder / f"shardflow-{version}"
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", commit],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    theirs = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["dependencies"]
    ours = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    if sorted(theirs) != sorted(ours):
        raise NoRelease(
            f"release {version} pins other dependencies than this code: "
            f"{sorted(set(theirs) ^ set(ours))}"
        )
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # its code first, then this environment's packages (processed after, in name order)
    (site / "_shardflow_release.pth").write_text(f"{tree / 'src'}\n")
    metadata = site / f"shardflow-{version}.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: shardflow\nVersion: {version}\n"
    )
    (metadata / "INSTALLER").write_text("shardflow tests\n")
    dependencies = sysconfig.get_paths()["purelib"]
    (site / "zz_dependencies.pth").write_text(f"import site; site.addsitedir({dependencies!r})\n")
    return Release(version, commit, python)


def _git(root: Path, *args: str) -> str:
    """What git says ("" where it fails, or where there is no git or no repository)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
