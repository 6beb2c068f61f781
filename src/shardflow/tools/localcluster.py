"""A real multi-node Ray cluster on this machine: a head node for control and N data nodes,
each its own process group (raylet, object store, workers), all bound to 127.0.0.1.

What runs is recorded in ``<data dir>/local-cluster/cluster.json`` so that later commands
(``shardflow cluster status``, ``add-node``, ``remove-node``, ``down``) find it. Nodes are
stopped by the process ids recorded there, never by name.

A cluster started with ``ha`` survives its head: the head keeps the cluster's state in Redis
(one started here on loopback with a password of its own, or one the caller names), a keeper
process starts the head again when it dies, at the same GCS port, and the running actors
serve meanwhile (Ray's GCS fault tolerance).

A cluster started with ``network`` (Linux, root) runs each Ray node in a network namespace of
its own, with an address of its own, and has one more namespace for clients, with a Ray node
of no CPUs for their drivers (``client_command``): links between them can be cut
(``tools/netns.py``), as a network partition would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shardflow.catalog.lease import process_running
from shardflow.config import LOOPBACK
from shardflow.errors import ConfigError
from shardflow.tools.netns import CLIENT, Network
from shardflow.tools.raynode import PASSWORD_VARIABLE

_children: dict[int, subprocess.Popen[bytes]] = {}
"""Node processes this process started (kept, so that their exit status is collected)."""
STATE_FOLDER = "local-cluster"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
REDIS_SERVER = "redis-server"
PASSWORD_FILE = "redis.password"


@dataclass(frozen=True)
class Redis:
    """A Redis server for the head's state: ``address`` (host:port) and its password."""

    address: str
    password: str


@dataclass(frozen=True)
class HighAvailability:
    """How the head of an ``ha`` cluster comes back: its Redis (``redis_pid`` when this
    cluster started it), its key prefix there, the GCS port and Ray's folder for the head."""

    redis: str
    namespace: str
    port: int
    temp_dir: str
    redis_pid: int = 0


@dataclass(frozen=True)
class LocalNode:
    """One Ray node process of the local cluster."""

    name: str
    pid: int
    node_id: str
    head: bool = False
    ip: str = LOOPBACK
    """Its address: loopback, or its own in a cluster started with ``network``."""

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
        state: dict[str, object] = {
            "address": address,
            "next_index": next_index,
            "nodes": [asdict(n) for n in nodes],
        }
        ha = self._ha_if_recorded()
        if ha is not None:
            state["ha"] = asdict(ha)
        network = self._network_if_recorded()
        if network is not None:
            state["network"] = network.to_json()
        self._write_state(state)

    def _write_state(self, state: dict[str, object]) -> None:
        partial = self.state_file.with_suffix(".partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(self.state_file)

    def _ha_if_recorded(self) -> HighAvailability | None:
        try:
            recorded = json.loads(self.state_file.read_text()).get("ha")
        except FileNotFoundError:
            recorded = self._pending_ha
        return HighAvailability(**recorded) if recorded else None

    _pending_ha: dict[str, object] | None = None
    """The ``ha`` part of a cluster being started (before its state is first saved)."""
    _pending_network: Network | None = None
    """The network of a cluster being started (before its state is first saved)."""

    def _network_if_recorded(self) -> Network | None:
        try:
            recorded = json.loads(self.state_file.read_text()).get("network")
        except FileNotFoundError:
            return self._pending_network
        return Network.from_json(recorded) if recorded else None

    @property
    def network(self) -> Network | None:
        """The namespaces of a cluster started with ``network`` (else None)."""
        return self._network_if_recorded()

    def client_command(self, command: list[str]) -> list[str]:
        """``command`` as run by a client of the cluster: in the clients' namespace where
        the cluster has its own network (its driver attaches to the Ray node there)."""
        network = self.network
        return [*network.run_in(CLIENT), *command] if network is not None else command

    @property
    def ha(self) -> HighAvailability | None:
        """How the head comes back, for a cluster started with ``ha`` (else None)."""
        recorded = self._load().get("ha")
        return HighAvailability(**recorded) if isinstance(recorded, dict) else None

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
        nodes = [LocalNode(**n) for n in self._load()["nodes"]]  # type: ignore[attr-defined]
        head = self.head_process()
        if head is None:
            return nodes
        return [dataclasses.replace(n, node_id=head[1]) if n.head else n for n in nodes]

    def head_process(self) -> tuple[int, str] | None:
        """The process id and Ray node id of the head of an ``ha`` cluster as it runs now
        (its keeper starts it again when it dies), or None while it is down."""
        try:
            started = json.loads((self.folder / "head.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return int(started["pid"]), str(started["node_id"])

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
        ha: bool = False,
        redis: Redis | None = None,
        network: bool = False,
    ) -> None:
        """Start the head and ``data_nodes`` data nodes (``started`` is told of each). With
        ``ha`` the head survives: its state is kept in ``redis`` (else in a Redis server
        started here, on loopback, with a password of its own) and a keeper restarts it.
        With ``network`` every node gets a network namespace of its own (root, Linux)."""
        if data_nodes < 1:
            raise ConfigError("a local cluster needs at least 1 data node")
        if self.running:
            raise ConfigError(
                f"a local cluster runs for {self.folder.parent} already, at {self.address} "
                "(`shardflow cluster down` stops it)"
            )
        if redis is not None and not ha:
            raise ConfigError("a Redis for the head's state is used with --ha")
        if network and ha:
            raise ConfigError("--ha and network namespaces are not combined yet")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.state_file.unlink(missing_ok=True)
        self._pending_ha = None
        self._pending_network = Network.create(str(self.folder)) if network else None
        password = ""
        if ha:
            redis = redis if redis is not None else self._start_redis()
            password = redis.password
            place = tempfile.mkdtemp(prefix="sf-head-")  # short: Ray's socket paths are in it
            self._pending_ha = asdict(
                HighAvailability(
                    redis=redis.address,
                    namespace=f"shardflow-{secrets.token_hex(6)}",
                    port=_free_port(),
                    temp_dir=place,
                    redis_pid=self._redis_pid,  # 0: the caller's Redis
                )
            )
        try:
            head = self._start("head", None, object_store_mb, data=False, password=password)
        except BaseException:
            self._stop_redis()
            if self._pending_ha is not None:
                shutil.rmtree(str(self._pending_ha["temp_dir"]), ignore_errors=True)
            if self._pending_network is not None:
                self._pending_network.remove()
            raise
        address = json.loads((self.folder / "head.json").read_text())["gcs_address"]
        self._save(str(address), [head], 1)
        self._pending_ha = None
        self._pending_network = None
        if started is not None:
            started(head)
        try:
            for _ in range(data_nodes):
                node = self.add_node(object_store_mb)
                if started is not None:
                    started(node)
            if network:  # the clients' Ray node, of no CPUs: their drivers attach to it
                client = self._start(CLIENT, self.address, object_store_mb, data=False)
                self._save(self.address, [*self.nodes(), client], self._next_index())
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
        index = self._next_index()
        if name is None:
            name, index = f"ray-{index}", index + 1
        elif any(n.name == name for n in self.nodes()):
            raise ConfigError(f"Ray node {name} runs already")
        node = self._start(name, self.address, object_store_mb, data=True, hide=hide)
        self._save(self.address, [*self.nodes(), node], index)
        return node

    def _next_index(self) -> int:
        return int(str(self._load()["next_index"]))

    # -- the head's Redis ---------------------------------------------------------------
    _redis_pid = 0

    def _start_redis(self) -> Redis:
        """Start Debian's ``redis-server`` on loopback for the head's state: a port of its
        own, a password made here (in a file only this user reads), nothing saved to disk
        (the cluster's state lives as long as the cluster does)."""
        binary = shutil.which(REDIS_SERVER)
        if binary is None:
            raise ConfigError(
                "--ha keeps the head's state in Redis, and redis-server is not installed "
                "(Debian: apt-get install redis-server), or name one with --redis HOST:PORT"
            )
        password = secrets.token_urlsafe(24)
        port = _free_port()
        config = self.folder / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(
            f"bind {LOOPBACK}\nport {port}\nrequirepass {password}\nprotected-mode yes\n"
            f'save ""\nappendonly no\ndir {self.folder}\n'
        )
        secret = self.folder / PASSWORD_FILE
        secret.touch(mode=0o600)
        secret.write_text(password)
        with open(self.folder / "redis.log", "ab") as log:
            process = subprocess.Popen(
                [binary, str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _children[process.pid] = process
        self._redis_pid = process.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection((LOOPBACK, port), timeout=1.0).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    _stop(process.pid)
                    raise ConfigError(
                        f"Redis did not start; see {self.folder / 'redis.log'}"
                    ) from None
                time.sleep(0.05)
        return Redis(f"{LOOPBACK}:{port}", password)

    def _stop_redis(self) -> None:
        pid = self._redis_pid
        if not pid and self.state_file.exists():
            ha = self._ha_if_recorded()
            pid = ha.redis_pid if ha is not None else 0
        if pid:
            _stop(pid)
            _reap(pid)
        self._redis_pid = 0

    # -- the head of an ha cluster ------------------------------------------------------
    def kill_head(self) -> int:
        """SIGKILL the head of an ``ha`` cluster and every process of it at once, as a
        machine that dies (its keeper starts it again); returns the killed process id."""
        if self.ha is None:
            raise ConfigError(
                "this cluster was started without --ha: losing its head loses the cluster "
                "(`shardflow cluster down`)"
            )
        head = self.head_process()
        if head is None:
            raise ConfigError("the head is down already (its keeper is starting it again)")
        _kill_tree(head[0])
        return head[0]

    def wait_head(self, killed: int, timeout: float = START_TIMEOUT_S) -> str:
        """Wait until the head killed as process ``killed`` runs again; its new node id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            head = self.head_process()
            if head is not None and head[0] != killed:
                return head[1]
            time.sleep(0.05)
        raise TimeoutError(f"the head did not come back within {timeout:g}s")

    def _start(
        self,
        name: str,
        address: str | None,
        object_store_mb: int,
        data: bool,
        hide: str | None = None,
        password: str = "",
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
        ha = self._ha_if_recorded() if address is None else None
        if ha is not None:
            command += ["--keep", "--redis", ha.redis, "--namespace", ha.namespace]
            command += ["--port", str(ha.port), "--temp-dir", ha.temp_dir]
        environment = dict(os.environ, **({PASSWORD_VARIABLE: password} if password else {}))
        ip = LOOPBACK
        network = self._network_if_recorded()
        if network is not None:  # a namespace and an address of its own
            ip = network.add(name)
            self._keep_network(network)
            command = [*network.run_in(name), *command, "--ip", ip]
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
                env=environment,
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
        return LocalNode(name, process.pid, str(started["node_id"]), address is None, ip)

    def _keep_network(self, network: Network) -> None:
        """Record the network's members (a namespace was added)."""
        if not self.state_file.exists():
            self._pending_network = network
            return
        state = json.loads(self.state_file.read_text())
        state["network"] = network.to_json()
        self._write_state(state)

    # -- stopping ---------------------------------------------------------------------
    def remove_node(self, name: str, kill: bool = False) -> LocalNode:
        """Stop a data node: gracefully (its processes are told to stop), or with ``kill``
        every process of it at once with SIGKILL, as a machine that dies."""
        node = self.node(name)
        if node.head and kill and self.ha is not None:
            self.kill_head()
            return node
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
        ha = self._ha_if_recorded()
        network = self._network_if_recorded()
        for node in sorted(nodes, key=lambda n: n.head):
            _stop(node.pid)
        if network is not None:
            network.remove()
        if ha is not None:
            self._stop_redis()
            shutil.rmtree(ha.temp_dir, ignore_errors=True)
            (self.folder / PASSWORD_FILE).unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        for pid in list(_children):  # also nodes another process removed (killed)
            _reap(pid)


def _free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


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
    """SIGKILL ``pids``; returns once none of them runs (a signal is delivered as the
    system gets to it: a node that still answered for a moment after a "kill" served the
    results a test meant to lose, seen on a busy machine)."""
    for target in pids:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pids:
        _reap(pids[0])
        if not any(process_running(p) for p in pids) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _reap(pid: int) -> None:
    """Collect the exit status of a node process this process started (no zombie left)."""
    process = _children.get(pid)
    if process is not None and process.poll() is not None:
        del _children[pid]
