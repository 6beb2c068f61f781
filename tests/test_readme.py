"""The README's Python and shell blocks, run as pasted, in the README's order, in one fresh
folder (each section's blocks together: "Serve it" starts its service in the background, as
the README does, and its Python block asks it once it listens). The harness only waits
where the README says to wait, and stops what a section left running if it failed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
README = Path(__file__).parents[1] / "README.md"
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```$", re.S | re.M)
SECTIONS = ("Use", "Zero-downtime scaling", "Devices, engines and observability", "Cluster",
            "Serve it", "Day two")  # fmt: skip
"""The sections with blocks to run, in the README's order (each builds on the one before)."""


def blocks() -> dict[str, list[tuple[str, str]]]:
    """Each section's runnable blocks: (language, text)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for part in re.split(r"^## ", README.read_text(), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        for language, text in BLOCK.findall(body):
            found.setdefault(title.strip(), []).append((language, text))
    return found


def test_every_runnable_block_is_run_here() -> None:
    assert set(blocks()) == set(SECTIONS), "a README block this test does not run"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder, as a user's; ``shardflow`` and ``python`` on the PATH as a user of
    the virtual environment has them."""
    return tmp_path_factory.mktemp("readme")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(folder: Path, script: str) -> subprocess.CompletedProcess[str]:
    bin_dir = str(Path(sys.executable).parent)
    return subprocess.run(
        ["bash", "-c", script],
        cwd=folder,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=900,
    )


def python(text: str) -> str:
    return f"python - <<'README_PYTHON'\n{text}README_PYTHON\n"


@pytest.mark.parametrize("section", SECTIONS)
def test_a_readme_section_runs_as_pasted(folder: Path, section: str) -> None:
    parts = blocks()[section]
    script = "set -euo pipefail\n"
    cleanup = ""
    if section == "Serve it":  # its port may be taken here: any free one, said everywhere
        port = str(free_port())
        parts = [(language, text.replace("8815", port)) for language, text in parts]
        # "Once it prints `Flight SQL on ...`": wait for its port, then ask it; `kill %1`
        shell, asked = parts[0][1], parts[1][1]
        wait = f"until (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; do sleep 0.2; done\n"
        script += shell + wait + python(asked) + "kill %1\nwait\n"
        cleanup = "kill %1 2>/dev/null; wait"
    else:
        for language, text in parts:
            script += python(text) if language == "python" else text
        if section == "Cluster":
            cleanup = "shardflow cluster down --data-dir sf-cluster"
    if cleanup:
        script = f"trap '{cleanup}' ERR\n" + script
    done = run(folder, script)
    assert done.returncode == 0, f"{section}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    said = done.stdout
    if section == "Use":
        assert "o_orderpriority" in said and "1-URGENT" in said
        assert (folder / ".shardflow" / "catalog").is_dir()
    if section == "Devices, engines and observability":
        assert 'id="axis"' in (folder / "q.html").read_text()
    if section == "Cluster":
        assert "local cluster stopped" in said
        assert " lost_rows=0 " in said and "failed_ops=0" in said  # the drill's report
    if section == "Serve it":
        assert said.count("kind") >= 2 and "Flight SQL on" in said
    if section == "Day two":
        assert "checked: ok" in said and "restored backup" in said and "bytes new of" in said
        assert "restored the data as of" in said and (folder / "then" / "catalog").is_dir()
