"""Query profiles render from plain data."""

from shardflow.telemetry.profile import FragmentProfile, QueryProfile, StageProfile


def fragment(worker: str, start: float, end: float) -> FragmentProfile:
    return FragmentProfile(
        worker, "cpu x", "duckdb", start - 0.001, start, end, 1000, 8000, 4, 64, 0.0002
    )


PROFILE = QueryProfile(
    "SELECT 1",
    started_at=100.0,
    planning_seconds=0.002,
    finished_at=100.05,
    stages=(
        StageProfile(
            1,
            "partial aggregate",
            "shards",
            100.002,
            100.04,
            (fragment("node-0", 100.003, 100.03), fragment("node-1", 100.004, 100.035)),
            merge_on="client",
            merge_started_at=100.04,
            merge_seconds=0.005,
            rows=4,
            sql="SELECT g, count(*) FROM t GROUP BY g",
            merge_sql="SELECT g, sum(n) FROM partials GROUP BY g",
        ),
        StageProfile(
            2,
            "replicated",
            "worker",
            100.045,
            100.05,
            (fragment("node-0", 100.046, 100.049),),
            rows=4,
        ),
    ),
    rows=4,
)


def test_text_tree_has_a_line_per_stage_fragment_and_merge() -> None:
    text = PROFILE.text()
    lines = text.splitlines()
    assert lines[0].startswith("query 50.0 ms (4 rows), planning 2.0 ms")
    assert sum("stage" in line for line in lines) == 2
    assert sum("node-" in line for line in lines) == 3
    assert "merge on the client: 5.0 ms" in text
    assert "wait 1.0 ms, run 27.0 ms, in 1000 rows / 8.0 KB, out 4 rows / 64 B" in text


def test_html_timeline_has_a_lane_per_worker_and_the_client() -> None:
    page = PROFILE.html()
    assert page.startswith("<!doctype html>") and page.count('class="lane"') == 3
    assert "node-0" in page and "node-1" in page and "client" in page
    assert "src=" not in page and "http" not in page  # self-contained: loads nothing


def test_html_timeline_has_an_axis_a_legend_and_the_sql_of_each_bar() -> None:
    page = PROFILE.html()
    assert page.count('class="tick"') == 6 and ">50.0 ms</div>" in page and ">0.0 ms<" in page
    for key in ("planning", "queued on the worker", "merge", "stage 1: partial aggregate",
                "stage 2: replicated"):  # fmt: skip
        assert f"</span>{key}</span>" in page
    assert 'data-sql="SELECT g, count(*) FROM t GROUP BY g"' in page
    assert 'data-sql="SELECT g, sum(n) FROM partials GROUP BY g"' in page
