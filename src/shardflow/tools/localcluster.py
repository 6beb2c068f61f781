"""A real multi-node Ray cluster on this machine: a head node for control and N data nodes,
each its own process group (raylet, object store, workers), all bound to 127.0.0.1.

What runs is recorded in ``<data dir>/local-cluster/cluster.json`` so that later commands
(``shardflow cluster status``, ``add-node``, ``remove-node``, ``down``) find it. Nodes are
stopped by the process ids recorded there, never by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shardflow.catalog.lease import process_running
from shardflow.errors import ConfigError

_children: dict[int, subprocess.Popen[bytes]] = {}
"""Node processes this process started (kept, so that their exit status is collected)."""
STATE_FOLDER = "local-cluster"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class LocalNode:
    """One Ray node process of the local cluster."""

    name: str
    pid: int
    node_id: str
    head: bool = False

    @property
    def alive(self) -> bool:
        return process_running(self.pid)


class LocalRayCluster:
    """The local cluster recorded under ``data_dir``."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = str(Path(data_dir).absolute())
        """The data directory the cluster serves (its state is kept in a folder there)."""
        self.folder = Path(data_dir).absolute() / STATE_FOLDER
        self.state_file = self.folder / "cluster.json"

    # -- what runs --------------------------------------------------------------------
    def _load(self) -> dict[str, object]:
        try:
            state: dict[str, object] = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"no local cluster runs for {self.folder.parent} (start one with "
                "`shardflow cluster up`)"
            ) from None
        return state

    def _save(self, address: str, nodes: list[LocalNode], next_index: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_suffix(".partial")
        state = {"address": address, "next_index": next_index, "nodes": [asdict(n) for n in nodes]}
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(self.state_file)

    @property
    def running(self) -> bool:
        """Whether a cluster is recorded here and its head is alive."""
        try:
            return any(n.head and n.alive for n in self.nodes())
        except ConfigError:
            return False

    @property
    def address(self) -> str:
        """The GCS address to connect to (``host:port``)."""
        return str(self._load()["address"])

    def nodes(self) -> list[LocalNode]:
        return [LocalNode(**n) for n in self._load()["nodes"]]  # type: ignore[attr-defined]

    def node(self, name: str) -> LocalNode:
        for node in self.nodes():
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes())
        raise ConfigError(f"no Ray node {name!r} in the local cluster (it has {known})")

    # -- starting ---------------------------------------------------------------------
    def up(
        self,
        data_nodes: int,
        object_store_mb: int = 256,
        started: Callable[[LocalNode], None] | None = None,
    ) -> None:
        """Start the head and ``data_nodes`` data nodes (``started`` is told of each)."""
        if data_nodes < 1:
            raise ConfigError("a local cluster needs at least 1 data node")
        if self.running:
            raise ConfigError(
                f"a local cluster runs for {self.folder.parent} already, at {self.address} "
                "(`shardflow cluster down` stops it)"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        head = self._start("head", None, object_store_mb, data=False)
        address = json.loads((self.folder / "head.json").read_text())["gcs_address"]
        self._save(str(address), [head], 1)
        if started is not None:
            started(head)
        try:
            for _ in range(data_nodes):
                node = self.add_node(object_store_mb)
                if started is not None:
                    started(node)
        except BaseException:
            self.down()
            raise

    def add_node(
        self, object_store_mb: int = 256, name: str | None = None, hide: str | None = None
    ) -> LocalNode:
        """Start one more data node, named ``ray-<n>`` (a number never used before) unless
        ``name`` gives the name of a node that was removed (a machine that comes back).
        ``hide`` (tests; root and Linux only) gives the node a mount namespace of its own
        with an empty folder at that path: a machine whose own disk lacks the data."""
        state = self._load()
        index = int(state["next_index"])  # type: ignore[call-overload]
        if name is None:
            name, index = f"ray-{index}", index + 1
        elif any(n.name == name for n in self.nodes()):
            raise ConfigError(f"Ray node {name} runs already")
        node = self._start(name, self.address, object_store_mb, data=True, hide=hide)
        self._save(self.address, [*self.nodes(), node], index)
        return node

    def _start(
        self,
        name: str,
        address: str | None,
        object_store_mb: int,
        data: bool,
        hide: str | None = None,
    ) -> LocalNode:
        info = self.folder / f"{name}.json"
        if hide is not None and info.absolute().is_relative_to(Path(hide).absolute()):
            info = Path(tempfile.mkdtemp(prefix="shardflow-node-")) / f"{name}.json"
        info.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "shardflow.tools.raynode",
            "--info",
            str(info),
            "--name",
            name,
            "--object-store-mb",
            str(object_store_mb),
            "--num-cpus",
            "1" if data else "0",
        ]
        command += ["--address", address] if address else ["--head"]
        if data:
            command.append("--data")
        if hide is not None:  # an empty folder over `hide`, in this node's own mount namespace
            mount = 'mount -t tmpfs shardflow-hidden "$0" && exec "$@"'
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount,
                       str(Path(hide).absolute()), *command]  # fmt: skip
        with open(self.folder / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as one node
            )
        _children[process.pid] = process
        deadline = time.monotonic() + START_TIMEOUT_S
        while not info.exists():
            if process.poll() is not None:
                raise ConfigError(
                    f"Ray node {name} did not start (exit code {process.returncode}); see "
                    f"{self.folder / (name + '.log')}"
                )
            if time.monotonic() > deadline:
                _kill_tree(process.pid)
                raise ConfigError(f"Ray node {name} did not start within {START_TIMEOUT_S:g}s")
            time.sleep(0.1)
        started = json.loads(info.read_text())
        return LocalNode(name, process.pid, str(started["node_id"]), head=address is None)

    # -- stopping ---------------------------------------------------------------------
    def remove_node(self, name: str, kill: bool = False) -> LocalNode:
        """Stop a data node: gracefully (its processes are told to stop), or with ``kill``
        every process of it at once with SIGKILL, as a machine that dies."""
        node = self.node(name)
        if node.head:
            raise ConfigError("the head node holds the Ray cluster; `shardflow cluster down`")
        if kill:
            _kill_tree(node.pid)
        else:
            _stop(node.pid)
        state = self._load()
        rest = [n for n in self.nodes() if n.name != name]
        self._save(self.address, rest, int(state["next_index"]))  # type: ignore[call-overload]
        return node

    def down(self) -> None:
        """Stop every node (data nodes first, then the head) and forget the cluster."""
        try:
            nodes = self.nodes()
        except ConfigError:
            return
        for node in sorted(nodes, key=lambda n: n.head):
            _stop(node.pid)
        self.state_file.unlink(missing_ok=True)
        for pid in list(_children):  # also nodes another process removed (killed)
            _reap(pid)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL a node's process and everything below it, all at once."""
    _kill_all([pid, *descendants(pid)])


def _stop(pid: int) -> None:
    """SIGTERM a node's process (it stops its node); SIGKILL what is left after a while."""
    if not process_running(pid):
        return
    below = descendants(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while process_running(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.1)
    _kill_all([p for p in [pid, *below] if process_running(p)])


def _kill_all(pids: list[int]) -> None:
    for target in pids:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        _reap(pids[0])


def _reap(pid: int) -> None:
    """Collect the exit status of a node process this process started (no zombie left)."""
    process = _children.get(pid)
    if process is not None and process.poll() is not None:
        del _children[pid]
