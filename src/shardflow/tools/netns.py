"""Network namespaces for a local cluster whose links can be cut (Linux, as root).

Each Ray node of a local cluster started with ``network`` runs in a network namespace of its
own with an address of its own, and clients run in one more (``client``); a bridge in a hub
namespace joins them. Nothing is made in the host's own namespace: each veth pair is made
inside the hub and its far end moved into the node's namespace at once, so the host's
interfaces, routes and firewall rules stay as they are, and the namespaces have no route
out. A link is cut with ``iptables`` rules inside a namespace (:meth:`Network.cut`) and
healed by removing them (:meth:`Network.heal`); the cluster removes its namespaces when it
goes down (:meth:`Network.remove`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from shardflow.errors import ConfigError

HUB = "hub"
BRIDGE = "br0"
CLIENT = "client"
"""The namespace clients of the cluster run in (with a Ray node of no CPUs their drivers
attach to: a driver needs a raylet on its own side of any cut)."""
TOOLS = ("ip", "iptables", "ss", "nsenter")
NETNS_FOLDER = "/run/netns"
"""Where ``ip netns`` keeps the namespaces it names."""


def available() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install iproute2 iptables)"
    return None


@dataclass
class Network:
    """The namespaces of one local cluster: ``prefix`` names them, ``subnet`` (three
    octets) numbers their addresses, ``members`` maps each member's name to its address."""

    prefix: str
    subnet: str
    members: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, seed: str) -> Network:
        """The hub of a new network, named and numbered after ``seed`` (the cluster's
        folder: two clusters get two networks)."""
        why = available()
        if why is not None:
            raise ConfigError(f"a cluster in network namespaces cannot start: {why}")
        digest = hashlib.sha256(seed.encode()).digest()
        network = cls(f"sf{digest[:3].hex()}", f"10.{200 + digest[3] % 50}.{digest[4]}")
        hub = network.namespace(HUB)
        if hub in _namespaces():
            raise ConfigError(f"network namespace {hub} exists already (a cluster left it?)")
        _ip("netns", "add", hub)
        try:
            _ip("-n", hub, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", hub, "link", "set", BRIDGE, "up")
        except BaseException:
            network.remove()
            raise
        return network

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def add(self, name: str) -> str:
        """A namespace for member ``name`` on the bridge; returns its address."""
        if name in self.members:
            return self.members[name]
        used = {int(address.rsplit(".", 1)[1]) for address in self.members.values()}
        number = min(set(range(1, 250)) - used)
        address = f"{self.subnet}.{number}"
        namespace, hub = self.namespace(name), self.namespace(HUB)
        veth = f"v{self.prefix[2:]}-{number}"  # at most 15 characters
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", veth, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)  # fmt: skip
        _ip("-n", hub, "link", "set", veth, "master", BRIDGE)
        _ip("-n", hub, "link", "set", veth, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        self.members[name] = address
        return address

    def run_in(self, name: str) -> list[str]:
        """The command prefix that runs a command in member ``name``'s network namespace.
        Only the network namespace: ``ip netns exec`` would give the command a mount
        namespace of its own too, and a namespace it made (a node it starts) would be
        seen there only."""
        return ["nsenter", f"--net={NETNS_FOLDER}/{self.namespace(name)}"]

    def cut(self, sender: str, receiver: str, *, one_way: bool = False) -> None:
        """Drop what ``sender`` sends to ``receiver`` and, unless ``one_way``, what it
        receives from it (rules in the sender's namespace: both sides see a silent peer)."""
        run = [*self.run_in(sender), "iptables", "-w"]
        peer = self.members[receiver]
        _run([*run, "-I", "OUTPUT", "-d", peer, "-j", "DROP"])
        if not one_way:
            _run([*run, "-I", "INPUT", "-s", peer, "-j", "DROP"])

    def heal(self) -> None:
        """Remove every cut."""
        for name in self.members:
            for chain in ("INPUT", "OUTPUT"):
                _run([*self.run_in(name), "iptables", "-w", "-F", chain])

    def sockets(self) -> list[tuple[str, str, str]]:
        """Every TCP connection in the members' namespaces: (member, local, peer)."""
        found = []
        for name in self.members:
            listed = _run([*self.run_in(name), "ss", "-tnH"]).stdout
            for line in listed.splitlines():
                columns = line.split()
                if len(columns) >= 5:
                    found.append((name, columns[3], columns[4]))
        return found

    def remove(self) -> None:
        """Remove every namespace of the network (what still runs in one keeps it until
        it ends; the cluster stops its processes first)."""
        existing = _namespaces()
        for name in [*self.members, HUB]:
            if self.namespace(name) in existing:
                _ip("netns", "delete", self.namespace(name))
        self.members.clear()

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Network:
        return cls(str(data["prefix"]), str(data["subnet"]), dict(data["members"]))  # type: ignore[call-overload]


def _namespaces() -> set[str]:
    listed = _run(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _ip(*arguments: str) -> None:
    _run(["ip", *arguments])


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done
