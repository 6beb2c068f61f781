"""Telling workers of catalog changes, each node what concerns it.

A move, split or merge changes which node owns a few units. The nodes that gain or lose
them are told just that (``catalog/delta.for_node``: the change folded with any earlier
ones they were not told of); the other nodes are told nothing, and their catalogs keep
older owners of units they never read. A change that concerns every node (a table created
or dropped, a node joining, leaving or excluded) is told to every node the same way, by
whoever makes it asking for it (``Coordinator.announce``, the controller's broadcast). A
node whose catalog the coordinator does not know (after a restart, or one that just
joined), or that answers its catalog is at another version than the changes were made to,
is sent the catalog whole. So a move costs network in proportion to the nodes it touches,
not to the cluster, and a table its own size times the nodes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

from shardflow.catalog import delta
from shardflow.errors import Error
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.protocol import CatalogJson, Reply, Workers

log = logging.getLogger(__name__)


class Announcer:
    """Tells workers of catalog changes and keeps the version each one serves."""

    def __init__(
        self, state: CoordinatorState, workers: Workers, timeout_s: float, measure: bool = False
    ) -> None:
        """``timeout_s``: how long a node's answer is waited for; ``measure``: count the
        bytes sent (:attr:`bytes_sent`; serialises what is sent once more, for benches)."""
        self.state = state
        self.workers = workers
        self.timeout_s = timeout_s
        self.measure = measure
        self._known: dict[str, int] = {}
        """The catalog version each node answered it serves, as told by us."""
        self._forgotten: set[str] = set()
        """Nodes that did not take a change (see :meth:`forgotten`)."""
        self._lock = threading.Lock()
        self.bytes_sent = 0
        """What was sent (JSON bytes), when ``measure``."""

    def served(self, node: str, version: int) -> None:
        """``node`` answered it serves ``version`` (a catalog sent whole, by anyone)."""
        with self._lock:
            if version > self._known.get(node, -1):
                self._known[node] = version
            self._forgotten.discard(node)

    def forgotten(self, nodes: Iterable[str]) -> list[str]:
        """Those of ``nodes`` that did not take a change told to them (an error, no answer
        in time) and have taken none since: each is sent the catalog whole next."""
        with self._lock:
            return [node for node in nodes if node in self._forgotten]

    def forget(self, node: str) -> None:
        """``node`` is gone, or did not answer: it is sent the catalog whole next time."""
        with self._lock:
            self._known.pop(node, None)
            self._forgotten.add(node)

    def announce(self, nodes: Iterable[str]) -> None:
        """Tell ``nodes`` (those a move touched; every node, for a change that concerns
        them all) of the changes since the version each serves, and wait for their
        answers."""
        live = set(self.state.catalog.nodes)
        whole: CatalogJson | None = None
        replies: list[tuple[str, Reply[int], bool]] = []
        for node in sorted(set(nodes) & live):
            changes = self._changes(node)
            if changes == []:
                continue  # it serves the current version already
            try:
                worker = self.workers.get(node)
                if changes is None:
                    whole = whole if whole is not None else self.state.catalog_json()
                    replies.append((node, worker.sync(whole), True))
                    self._count(whole)
                else:
                    replies.append((node, worker.follow(changes), False))
                    self._count(changes)
            except Error as error:
                log.info("%s not told of the catalog: %s", node, error)
                self.forget(node)
        for node, reply, was_whole in replies:
            self._settle(node, reply, was_whole)

    def _changes(self, node: str) -> list[dict[str, Any]] | None:
        """What ``node`` is to be told: the changes since the version it serves, as it
        is told them (empty: none); None where it is to be sent the catalog whole."""
        with self._lock:
            known = self._known.get(node)
        if known is None:
            return None
        changes = self.state.changes_since(known)
        return None if changes is None else delta.for_node(changes, node)

    def _count(self, message: object) -> None:
        if self.measure:
            self.bytes_sent += len(json.dumps(message, separators=(",", ":")))

    def _settle(self, node: str, reply: Reply[int], was_whole: bool) -> None:
        try:
            version = reply.get(self.timeout_s)
        except Error as error:
            log.info("%s did not take the catalog: %s", node, error)
            self.forget(node)
            return
        if version >= 0:
            self.served(node, version)
            return
        self.forget(node)  # its catalog is at another version than the changes'
        if was_whole:
            return
        try:
            whole = self.state.catalog_json()
            self._count(whole)
            self.served(node, self.workers.get(node).sync(whole).get(self.timeout_s))
        except Error as error:
            log.info("%s did not take the catalog: %s", node, error)
