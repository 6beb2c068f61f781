"""Query profiles: where a query's time went, as a text tree and as an HTML timeline with
one lane per worker (and one for the client)."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FragmentProfile:
    worker: str
    device: str
    engine: str
    submitted_at: float
    started_at: float
    finished_at: float
    rows_in: int
    bytes_in: int
    rows_out: int
    bytes_out: int
    transfer_seconds: float
    """Fetching the fragment's result to where it was merged (0 when it stayed remote)."""
    via: str = ""
    """How it was asked: "ray", or "fast lane" (a connection of the session's own)."""

    @property
    def queue_wait(self) -> float:
        return max(0.0, self.started_at - self.submitted_at)

    @property
    def seconds(self) -> float:
        return self.finished_at - self.started_at


@dataclass(frozen=True)
class StageProfile:
    number: int
    strategy: str
    placement: str
    started_at: float
    finished_at: float
    fragments: tuple[FragmentProfile, ...]
    merge_on: str | None = None
    merge_started_at: float | None = None
    merge_seconds: float = 0.0
    rows: int = 0
    sql: str = ""
    """What each fragment of the stage ran."""
    merge_sql: str = ""


@dataclass(frozen=True)
class QueryProfile:
    sql: str
    started_at: float
    planning_seconds: float
    finished_at: float
    stages: tuple[StageProfile, ...] = field(default_factory=tuple)
    rows: int = 0

    @property
    def seconds(self) -> float:
        return self.finished_at - self.started_at

    def to_json(self) -> dict[str, Any]:
        """The profile as plain data (how a served cluster sends it)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueryProfile:
        """The profile :meth:`to_json` wrote."""
        stages = tuple(
            StageProfile(
                **{
                    **stage,
                    "fragments": tuple(FragmentProfile(**f) for f in stage["fragments"]),
                }
            )
            for stage in data["stages"]
        )
        return cls(**{**data, "stages": stages})

    def text(self) -> str:
        """The profile as a tree, one line per stage, fragment and merge."""
        lines = [
            f"query {_ms(self.seconds)} ({self.rows} rows), planning {_ms(self.planning_seconds)}"
        ]
        for index, stage in enumerate(self.stages):
            last_stage = index == len(self.stages) - 1
            branch, rail = ("└─", "   ") if last_stage else ("├─", "│  ")
            where = "shards" if stage.placement == "shards" else stage.placement
            lines.append(
                f"{branch} stage {stage.number}: {stage.strategy} on {where}, "
                f"{_ms(stage.finished_at - stage.started_at)}, {stage.rows} rows"
            )
            entries = [_fragment_line(f) for f in stage.fragments]
            if stage.merge_on:
                entries.append(f"merge on the {stage.merge_on}: {_ms(stage.merge_seconds)}")
            for position, entry in enumerate(entries):
                mark = "└─" if position == len(entries) - 1 else "├─"
                lines.append(f"{rail}{mark} {entry}")
        return "\n".join(lines)

    def html(self) -> str:
        """A self-contained HTML page: the query's timeline, one lane per worker."""
        start, total = self.started_at, max(self.seconds, 1e-6)
        lanes: dict[str, list[str]] = {"client": []}
        legend = {"plan": "planning", "wait": "queued on the worker", "merge": "merge"}

        def bar(
            lane: str, begin: float, end: float, label: str, kind: str, tip: str, sql: str = ""
        ) -> None:
            left = 100 * (begin - start) / total
            width = max(0.3, 100 * (end - begin) / total)
            lanes.setdefault(lane, []).append(
                f'<div class="bar {kind}" style="left:{left:.3f}%;width:{width:.3f}%"'
                f' title="{html.escape(tip)}" data-tip="{html.escape(tip)}"'
                f' data-sql="{html.escape(sql)}">{html.escape(label)}</div>'
            )

        bar(
            "client",
            start,
            start + self.planning_seconds,
            "plan",
            "plan",
            f"planning {_ms(self.planning_seconds)}",
        )
        for stage in self.stages:
            kind = f"stage{stage.number % 6}"
            legend[kind] = f"stage {stage.number}: {stage.strategy}"
            for f in stage.fragments:
                tip = f"stage {stage.number} {stage.strategy}: {_fragment_line(f)}"
                if f.queue_wait > 0:
                    bar(f.worker, f.submitted_at, f.started_at, "", "wait", f"queued {tip}")
                bar(f.worker, f.started_at, f.finished_at, f"s{stage.number}", kind, tip,
                    stage.sql)  # fmt: skip
            if stage.merge_on and stage.merge_started_at is not None:
                lane = "client" if stage.merge_on == "client" else "merge worker"
                bar(
                    lane,
                    stage.merge_started_at,
                    stage.merge_started_at + stage.merge_seconds,
                    f"m{stage.number}",
                    "merge",
                    f"stage {stage.number} merge",
                    stage.merge_sql,
                )
        ticks = "".join(
            f'<div class="tick" style="left:{100 * i / TICKS:.3f}%">{_ms(total * i / TICKS)}</div>'
            for i in range(TICKS + 1)
        )
        keys = "".join(
            f'<span class="key"><span class="swatch {kind}"></span>{html.escape(text)}</span>'
            for kind, text in legend.items()
        )
        rows = "".join(
            f'<div class="lane"><div class="name">{html.escape(name)}</div>'
            f'<div class="track">{"".join(bars)}</div></div>'
            for name, bars in sorted(lanes.items(), key=lambda kv: (kv[0] != "client", kv[0]))
        )
        return _PAGE.format(
            title=html.escape(f"shardflow query profile: {_ms(self.seconds)}"),
            sql=html.escape(self.sql.strip()),
            tree=html.escape(self.text()),
            lanes=rows,
            ticks=ticks,
            legend=keys,
        )


TICKS = 5
"""Intervals on the timeline's axis (ticks at 0, 20, ... 100 % of the query's time)."""


def _fragment_line(f: FragmentProfile) -> str:
    return (
        f"{f.worker} [{f.device}, {f.engine}]{f' via {f.via}' if f.via else ''}: "
        f"wait {_ms(f.queue_wait)}, run {_ms(f.seconds)}, "
        f"in {f.rows_in} rows / {_size(f.bytes_in)}, out {f.rows_out} rows / "
        f"{_size(f.bytes_out)}, transfer {_ms(f.transfer_seconds)}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
pre {{ background: #f6f6f6; padding: .8em; overflow-x: auto; }}
.lane {{ display: flex; align-items: center; margin: 3px 0; }}
.name {{ width: 9em; font-size: 13px; }}
.track {{ position: relative; flex: 1; height: 22px; background: #fafafa;
          border: 1px solid #e4e4e4; }}
.bar {{ position: absolute; top: 2px; height: 16px; font-size: 11px; color: #fff;
        overflow: hidden; white-space: nowrap; border-radius: 2px; }}
.plan {{ background: #7a7a7a; }} .wait {{ background: #d9d9d9; }} .merge {{ background: #222; }}
.stage0 {{ background: #3f6fb5; }} .stage1 {{ background: #d9822b; }}
.stage2 {{ background: #2f9e6b; }} .stage3 {{ background: #b5473f; }}
.stage4 {{ background: #7d5bb5; }} .stage5 {{ background: #3fa2b5; }}
.bar {{ cursor: pointer; }} .bar.selected {{ outline: 2px solid #000; }}
#axis {{ position: relative; height: 18px; margin-left: 9em; border-top: 1px solid #999; }}
.tick {{ position: absolute; top: 0; font-size: 11px; color: #555; transform: translateX(-50%);
         border-left: 1px solid #999; padding-top: 2px; }}
#legend {{ margin: .8em 0; font-size: 12px; }}
.key {{ margin-right: 1.2em; white-space: nowrap; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px;
           vertical-align: middle; border-radius: 2px; }}
#details {{ min-height: 3em; }}
</style></head><body>
<h2>{title}</h2>
<div id="lanes">{lanes}</div>
<div id="axis">{ticks}</div>
<div id="legend">{legend}</div>
<p style="font-size:12px;color:#666">Hover a bar for its figures; click it for the SQL it ran.</p>
<h3>Selected</h3><div id="details"><pre id="detail-tip">(click a bar)</pre>
<pre id="detail-sql"></pre></div>
<h3>Profile</h3><pre>{tree}</pre>
<h3>Query</h3><pre>{sql}</pre>
<script>
document.querySelectorAll(".bar").forEach(function (bar) {{
  bar.addEventListener("click", function () {{
    document.querySelectorAll(".bar.selected").forEach(function (b) {{
      b.classList.remove("selected");
    }});
    bar.classList.add("selected");
    document.getElementById("detail-tip").textContent = bar.dataset.tip;
    document.getElementById("detail-sql").textContent = bar.dataset.sql || "(no SQL: waiting)";
  }});
}});
</script>
</body></html>
"""
