"""Which Ray nodes run workers, for a cluster joined by address (``auto_join``): the
coordinator watches the Ray cluster, starts and admits a worker on every slot of a Ray node
that has none (one that joined, or whose worker died), follows Ray's own drains (``ray
drain-node``, the autoscaler, KubeRay scaling down) by draining the workers there before
their deadline, and never starts a worker again on a Ray node that is leaving or cannot
reach the data directory."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Protocol

import ray
from ray._private import state as ray_state
from ray.exceptions import RayTaskError

from shardflow.catalog import DataDir, OwnerToken
from shardflow.config import Settings
from shardflow.errors import ConfigError, Error
from shardflow.runtime.protocol import DrainReport, Worker, admit_workers
from shardflow.runtime.ray.slots import Slot, slot_options, worker_slots
from shardflow.runtime.worker.local import check_shared

if TYPE_CHECKING:
    from shardflow.runtime.coordinator.node import CoordinatorNode

log = logging.getLogger(__name__)
JOIN_INTERVAL_S = 2.0
"""How often a coordinator with ``auto_join`` looks for Ray nodes without workers, and for
Ray nodes being drained."""
RAY_DRAIN_DEFAULT_S = 300.0
"""How long the workers of a Ray node drained without a deadline may take to drain."""
RAY_DRAIN_MARGIN_S = 5.0
"""Drains end this long before the Ray node's own drain deadline."""


class Starter(Protocol):
    """Starts a cluster's worker actors (``bootstrap.Spawner``)."""

    def spawn(self, node: str, slot: Slot, slowdown: float = 1.0) -> Worker:
        """The worker actor of ``node`` on ``slot``; it loads what the catalog assigns it."""
        ...


class Membership:
    """The Ray nodes of one coordinator's cluster, and its workers on them."""

    def __init__(
        self, coordinator: CoordinatorNode, starter: Starter, data_dir: str, settings: Settings
    ) -> None:
        self.coordinator = coordinator
        self.starter = starter
        self.data_dir = data_dir
        self.settings = settings
        self._leaving: set[str] = set()
        """Ray nodes being drained to leave: no worker is started on them again."""
        self._refused: dict[str, str] = {}
        """Ray nodes that cannot serve (they do not reach the data directory), and why."""
        self._joining = threading.Lock()

    def start(self) -> None:
        """From now on (the cluster's first workers run), follow the Ray cluster."""
        if self.settings.auto_join:
            threading.Thread(target=self._loop, name="join", daemon=True).start()

    def _loop(self) -> None:
        while not self.coordinator.controller.stopped.wait(JOIN_INTERVAL_S):
            try:
                self._follow_ray_drains()
                self.join_new_nodes()
            except Exception:  # the next round tries again; the loop must not die
                log.exception("following the Ray nodes failed")

    def _follow_ray_drains(self) -> None:
        """A Ray node being drained is leaving gracefully: drain its workers before its
        deadline."""
        draining: dict[str, int] = ray_state.state.get_draining_nodes()
        for ray_node_id, deadline_ms in draining.items():
            with self._joining:
                if ray_node_id in self._leaving:
                    continue
                self._leaving.add(ray_node_id)
            left = deadline_ms / 1000 - time.time() if deadline_ms else RAY_DRAIN_DEFAULT_S
            deadline_s = max(1.0, left - RAY_DRAIN_MARGIN_S)
            log.info("Ray node %s is draining: draining its workers (%.0fs)", ray_node_id, left)
            threading.Thread(target=self.leave, args=(ray_node_id, deadline_s), daemon=True).start()

    def join_new_nodes(self) -> list[str]:
        """Start a worker on every slot of an alive Ray node that has none; returns the
        nodes that joined."""
        with self._joining:
            held = Counter(self.coordinator.hosts().values())
            joined = []
            for slot in worker_slots(ray.nodes()):  # type: ignore[no-untyped-call]
                if slot.ray_node_id in self._leaving or slot.ray_node_id in self._refused:
                    continue
                if held[slot.ray_node_id] > 0:
                    held[slot.ray_node_id] -= 1
                    continue
                node = self._join(slot)
                if node is not None:
                    joined.append(node)
            return joined

    def _join(self, slot: Slot) -> str | None:
        state = self.coordinator.state
        try:
            check_storage_on([slot], self.data_dir, state.owner)
        except ConfigError as error:  # it will not reach it later either: never asked again
            log.warning("Ray node %s gets no worker: %s", slot.name, error)
            self._refused[slot.ray_node_id] = str(error)
            return None
        node = state.reserve_node()
        worker = self.starter.spawn(node, slot)
        try:
            admit_workers([worker], self.settings.retry_deadline_s)
        except Error as error:  # its Ray node went away meanwhile
            log.warning("%s did not start on Ray node %s: %s", node, slot.name, error)
            self.coordinator.workers.stop(node)
            return None
        self.coordinator.admitted(node, slot.ray_node_id)
        log.info("%s joined on Ray node %s (%s)", node, slot.name, slot.ray_node_id)
        return node

    def leave(self, ray_node_id: str, deadline_s: float) -> list[DrainReport]:
        """Drain every worker on a Ray node that is about to leave, and stop them; no
        worker starts there again."""
        with self._joining:
            self._leaving.add(ray_node_id)
        return self.coordinator.drain_host(ray_node_id, deadline_s)


def check_storage_on(slots: list[Slot], data_dir: str, owner: OwnerToken) -> None:
    """Every Ray node of ``slots`` must read the lease the coordinator wrote in
    ``data_dir``: a cluster of several machines needs the data directory on shared storage.
    Raises ``ConfigError`` naming a node that cannot (checked by a small task there)."""
    checks = [
        _storage_check.options(**slot_options(slot.cpu_only(), False)).remote(
            data_dir, owner, slot.name or slot.ray_node_id
        )
        for slot in {s.ray_node_id: s for s in slots}.values()
    ]
    for ref in checks:
        try:
            ray.get(ref)
        except RayTaskError as error:
            cause = error.cause
            raise cause if isinstance(cause, ConfigError) else error from None


@ray.remote(num_cpus=0, max_retries=0)
def _storage_check(data_dir: str, owner: OwnerToken, node: str) -> None:
    check_shared(DataDir.resolve(data_dir), owner, f"Ray node {node}")
