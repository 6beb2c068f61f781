"""Turning an execution report into a query profile (see ``telemetry/profile.py``)."""

from __future__ import annotations

from shardflow.runtime.executor import ExecutionReport
from shardflow.telemetry.profile import FragmentProfile, QueryProfile, StageProfile


def build_profile(sql: str, report: ExecutionReport) -> QueryProfile:
    stages = []
    for number, stage in enumerate(report.stages, start=1):
        fragments = []
        for fragment in stage.fragments:
            stats = fragment.stats
            started = float(stats.get("started_at", stage.started_at))
            fragments.append(
                FragmentProfile(
                    worker=fragment.worker,
                    device=str(stats.get("device", "")),
                    engine=str(stats.get("engine", "")),
                    submitted_at=fragment.submitted_at or started,
                    started_at=started,
                    finished_at=float(stats.get("finished_at", started + fragment.seconds)),
                    rows_in=int(stats.get("rows_in", 0)),
                    bytes_in=int(stats.get("bytes_in", 0)),
                    rows_out=fragment.rows,
                    bytes_out=int(stats.get("bytes_out", 0)),
                    transfer_seconds=_transfer(fragment.output),
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
