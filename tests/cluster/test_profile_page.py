"""The profiler page reads like a tool: rendered in headless Chromium (Debian's
``chromium``), it has a time axis with ticks, a colour legend, and a click on a bar shows
the SQL that fragment ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chromium import Chromium
from tests.unit.test_profile import PROFILE

pytestmark = pytest.mark.cluster


def test_the_profile_page_has_an_axis_a_legend_and_shows_a_fragments_sql(
    tmp_path: Path, chromium: Chromium
) -> None:
    page_file = tmp_path / "profile.html"
    page_file.write_text(PROFILE.html(), encoding="utf-8")
    page = chromium.open(page_file.as_uri())
    try:
        ticks = page.evaluate(
            "Array.from(document.querySelectorAll('#axis .tick')).map(t => t.textContent)"
        )
        assert ticks == ["0.0 ms", "10.0 ms", "20.0 ms", "30.0 ms", "40.0 ms", "50.0 ms"]
        positions = page.evaluate(
            "Array.from(document.querySelectorAll('#axis .tick'))"
            ".map(t => t.getBoundingClientRect().left)"
        )
        assert positions == sorted(positions) and positions[-1] - positions[0] > 300  # laid out
        legend = page.evaluate(
            "Array.from(document.querySelectorAll('#legend .key')).map(k => [k.textContent,"
            " getComputedStyle(k.querySelector('.swatch')).backgroundColor])"
        )
        keys = dict(legend)
        assert "stage 1: partial aggregate" in keys and "merge" in keys
        assert keys["stage 1: partial aggregate"] != keys["stage 2: replicated"]  # colours
        assert page.evaluate("document.getElementById('detail-sql').textContent") == ""
        page.evaluate("document.querySelector('.bar.stage1').click()")
        assert page.evaluate("document.getElementById('detail-sql').textContent") == (
            "SELECT g, count(*) FROM t GROUP BY g"
        )
        assert "node-0" in page.evaluate("document.getElementById('detail-tip').textContent")
    finally:
        page.close()
