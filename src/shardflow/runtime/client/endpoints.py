"""Answers read straight from the workers (``Database.endpoints``; the Flight SQL service's
``flight_endpoints = "workers"``): where a query's answer is its fragments' results put one
after the other (the answers :func:`~shardflow.runtime.client.streams.streams` reads as they
arrive), each worker holding units of it reserves its part for one read from its own
Flight endpoint (``runtime/worker/endpoint.py``), and the client reads every part from the
worker that holds it, all at once.

The reservation binds the part to the worker's shards at the routing it was asked at: a
move, split or merge after it leaves them readable there until the part is read or its
ticket expires (``endpoint_ticket_ttl_s``), so a client never misses a row or reads one
twice however the cluster changes between the reservation and the read. Reserving itself is
retried as a fragment is (a unit that moved just before: routing refreshed, asked again)."""

from __future__ import annotations

import logging

import pyarrow as pa

from shardflow.errors import Retryable
from shardflow.records import AnswerPart
from shardflow.runtime.client.runner import RoutedRunner, stage_units, units_by_node
from shardflow.runtime.client.streams import StreamHost, streams
from shardflow.runtime.fastlane import LaneBroken
from shardflow.runtime.protocol import LaneAddress, PartRequest, credential_digest
from shardflow.sql.plan import WHOLE

log = logging.getLogger(__name__)


def reserve_parts(
    session: StreamHost, sql: str, user: str, credential: str, tls: bool = False
) -> tuple[pa.Schema, list[AnswerPart]] | None:
    """``sql``'s answer reserved in parts on the workers that hold them: its schema and an
    :class:`AnswerPart` per worker (read by ``credential``'s holder only; ``user`` names
    them in the audit log); None where it cannot be read so (a merge or a final step, one
    unit, a worker without an endpoint, or with ``tls`` one whose endpoint speaks none)."""
    planned = session.plan(sql)
    group = session.catalog.groups.get(planned.plan.result.group or "")
    if group is None or not streams(planned.plan, len(group.units)):
        return None
    stage = planned.plan.result
    runner = RoutedRunner(session, session.fragment_calls())
    caller = credential_digest(credential)
    ttl_s = session.settings.endpoint_ticket_ttl_s

    def attempt() -> list[AnswerPart] | None:
        catalog = session.catalog
        commits = runner.commits(stage.tables)
        group, current = stage_units(stage, catalog)
        by_node = units_by_node(group, current)
        if stage.strategy == WHOLE and len(by_node) > 1:  # planned on one node: several now
            return None
        located: dict[str, LaneAddress] = {}
        for node in by_node:
            address = session.lanes.address(node)
            if address is None or not address.endpoint:
                return None
            if tls and not address.endpoint.startswith("grpc+tls://"):
                return None
            located[node] = address
        futures = {
            node: session.lanes.pool.submit(
                session.lanes.lanes.reserve,
                located[node],
                PartRequest(
                    stage.sql, {table: units for table in stage.tables}, catalog.epoch,
                    commits, planned.schema, user, caller, ttl_s,
                ),
            )
            for node, units in by_node.items()
        }  # fmt: skip
        parts: list[AnswerPart] = []
        failed: Exception | None = None
        for node, future in sorted(futures.items()):
            try:
                parts.append(AnswerPart(node, located[node].endpoint, future.result()))
            except LaneBroken as error:
                session.lanes.broken(node, error)
                failed = failed or Retryable(f"the fast lane to {node} failed: {error}")
            except Exception as error:  # the first one is raised below
                failed = failed or error
        if failed is not None:  # the parts reserved already are let go at once
            _cancel(session, located, parts)
            raise failed
        return parts

    parts = session.retrying("query", attempt)
    return None if parts is None else (planned.schema, parts)


def _cancel(session: StreamHost, located: dict[str, LaneAddress], parts: list[AnswerPart]) -> None:
    """Let go of ``parts`` unread (another worker's part of the answer failed): their
    shards would otherwise stay held until the tickets expire. A worker that does not
    answer lets its part go at expiry all the same."""
    for part in parts:
        try:
            session.lanes.lanes.cancel(located[part.node], part.ticket)
        except Exception as error:  # it expires there: the answer's own error matters
            log.info("%s kept its part of a failed answer until it expires: %s", part.node, error)
