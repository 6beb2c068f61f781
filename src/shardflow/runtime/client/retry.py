"""The one retry loop of the client: what a retry can cure — a ``Retryable`` error (a shard
moved, a worker or the coordinator gone or slow) or work an attempt left undone — is tried
again after a back-off, until the deadline."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from shardflow.errors import ClosedError, ClusterError, Retryable

log = logging.getLogger(__name__)
T = TypeVar("T")
FIRST_RETRY_DELAY_S = 0.05
MAX_RETRY_DELAY_S = 1.0


class Unfinished(Exception):
    """An attempt left work to do (parts whose worker moved or died): try again."""


def retrying(
    what: str,
    attempt: Callable[[], T],
    deadline_s: float,
    between: Callable[[], object] | None = None,
    closed: threading.Event | None = None,
    version: Callable[[], int] | None = None,
) -> T:
    """The one retry loop: call ``attempt`` until it returns. What a retry can cure — a
    ``Retryable`` error (a shard moved, a worker or the coordinator gone or slow) or work
    left undone — is tried again after a back-off (50 ms, doubling up to 1 s), with
    ``between`` run before each new attempt (the session refreshes its routing there),
    until ``deadline_s`` (``retry_deadline_s``) has passed, or until ``closed`` is set (the
    session was closed under the call: :class:`ClosedError`).

    With ``version`` (the routing's version now), ``between`` runs at once after a failure
    first: where it brought routing newer than the failed attempt ran with (a move switched
    since, the usual cause of ``Moved``), the next attempt goes without waiting. A wait
    then would only add its 50 ms to every query that meets a move; the back-off is for
    what fresh routing does not cure (a node not told yet, a worker restarting)."""
    deadline = time.monotonic() + deadline_s
    delay = FIRST_RETRY_DELAY_S
    while True:
        began_with = version() if version is not None else None
        try:
            return attempt()
        except (Retryable, Unfinished) as error:
            if closed is not None and closed.is_set():
                raise ClosedError(f"{what}: the database was closed") from error
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{what}: no success within {deadline_s:g}s (retry_deadline_s): {error};"
                    " check db.cluster.nodes()"
                ) from None
        if version is not None and between is not None:
            between()
            if version() != began_with:  # newer routing: go again now
                continue
        time.sleep(delay)
        delay = min(delay * 2, MAX_RETRY_DELAY_S)
        if between is not None:
            between()


def submit_all(submissions: Mapping[str, Callable[[], T]]) -> dict[str, T]:
    """Submit each node's call; a node whose worker is gone is left out (its part is still
    pending, and the caller retries it with fresh routing)."""
    submitted = {}
    for node, submit in submissions.items():
        try:
            submitted[node] = submit()
        except Retryable as error:
            log.info("%s: %s; retried with fresh routing", node, error)
    return submitted
