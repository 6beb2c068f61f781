"""Queries' outcomes and inserts' row counts, batched for the coordinator's metrics."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
TALLY_INTERVAL_S = 0.25


class Tally:
    """Queries' outcomes and inserts' row counts for the coordinator's metrics, sent in
    batches: at most every :data:`TALLY_INTERVAL_S` (one call instead of one per query or
    insert, which at hundreds a second costs the coordinator and the client more than the
    work). Nothing is sent once :meth:`close` returns (Ray may be gone then)."""

    def __init__(self, send: Callable[[list[tuple[float, bool]], list[int]], object]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._queries: list[tuple[float, bool]] = []
        self._inserts: list[int] = []
        self._timer: threading.Timer | None = None
        self._closed = False

    def query(self, seconds: float, ok: bool) -> None:
        with self._lock:
            if not self._closed:
                self._queries.append((seconds, ok))
                self._soon()

    def insert(self, rows: int) -> None:
        with self._lock:
            if not self._closed:
                self._inserts.append(rows)
                self._soon()

    def _soon(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(TALLY_INTERVAL_S, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Send what is pending (sent under the lock, so never after :meth:`close`)."""
        with self._lock:
            self._send_locked()

    def close(self) -> None:
        """Send what is pending, and nothing after."""
        with self._lock:
            self._send_locked()
            self._closed = True

    def _send_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queries, inserts = self._queries, self._inserts
        self._queries, self._inserts = [], []
        if queries or inserts:
            try:
                self._send(queries, inserts)
            except Exception as error:  # metrics only: a query never fails for them
                log.debug("outcomes not recorded: %s", error)
