"""Turning an execution report into a query profile (see ``telemetry/profile.py``)."""

from __future__ import annotations

from shardflow.runtime.protocol import FragmentStats
from shardflow.runtime.query.executor import ExecutionReport
from shardflow.telemetry.profile import FragmentProfile, QueryProfile, StageProfile


def build_profile(sql: str, report: ExecutionReport) -> QueryProfile:
    stages = []
    for number, stage in enumerate(report.stages, start=1):
        fragments = []
        for fragment in stage.fragments:
            stats = fragment.stats or FragmentStats(fragment.seconds, fragment.rows)
            started = stats.started_at if stats.started_at is not None else stage.started_at
            finished = stats.finished_at
            fragments.append(
                FragmentProfile(
                    worker=fragment.worker,
                    device=stats.device,
                    engine=stats.engine,
                    submitted_at=fragment.submitted_at or started,
                    started_at=started,
                    finished_at=finished if finished is not None else started + fragment.seconds,
                    rows_in=stats.rows_in,
                    bytes_in=stats.bytes_in,
                    rows_out=fragment.rows,
                    bytes_out=stats.bytes_out,
                    transfer_seconds=_transfer(fragment.output),
                    via=fragment.via,
                )
            )
        stages.append(
            StageProfile(
                number=number,
                strategy=stage.strategy,
                placement=stage.placement,
                started_at=stage.started_at,
                finished_at=stage.started_at + stage.wall_seconds,
                fragments=tuple(fragments),
                merge_on=stage.merge_on,
                merge_started_at=stage.merge_started_at,
                merge_seconds=stage.merge_seconds,
                rows=stage.rows,
                sql=stage.sql,
                merge_sql=stage.merge_sql,
            )
        )
    return QueryProfile(
        sql=sql,
        started_at=report.started_at - report.plan_seconds,
        planning_seconds=report.plan_seconds,
        finished_at=report.started_at + report.wall_seconds,
        stages=tuple(stages),
        rows=report.rows,
    )


def _transfer(output: object) -> float:
    return float(getattr(output, "transfer_seconds", 0.0))
