"""The coordinator's console page in a real browser (Debian's headless Chromium) on a real
local Ray cluster: the page, left open and never reloaded, shows a node that joins and a
shard migrating to it — in flight with its phase, then on its new node."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import shardflow
from shardflow.control.migration import TERMINAL, Phase
from tests.support.chromium import Chromium, Page

pytestmark = pytest.mark.cluster
IN_FLIGHT = {p.value for p in Phase} - {p.value for p in TERMINAL}

READ_PAGE = """(() => ({
  updates: Number(document.getElementById("updated").dataset.count),
  status: document.getElementById("status").textContent,
  qps: Number(document.getElementById("qps").textContent),
  nodes: [...document.querySelectorAll("#nodes tbody tr[data-node]")].map((row) => ({
    name: row.dataset.node,
    alive: row.querySelector('[data-field="alive"]').textContent,
    device: row.querySelector('[data-field="device"]').textContent,
  })),
  map_rows: [...document.querySelectorAll("#map tbody tr[data-node]")].map((r) => r.dataset.node),
  shards: [...document.querySelectorAll("#map [data-shard]")].map(
    (s) => [s.dataset.shard, s.dataset.node]),
  moves: [...document.querySelectorAll("#moves tbody tr[data-move]")].map((row) => ({
    shards: row.children[2].textContent,
    to: row.children[4].textContent,
    phase: row.dataset.phase,
  })),
  opened_once: window.openedOnce === true,
}))()"""
"""What the page shows now, read from its DOM. ``openedOnce`` is set by the test when the
page opens: a reload would lose it."""


def shown(page: Page) -> dict[str, Any]:
    view: dict[str, Any] = page.evaluate(READ_PAGE)
    return view


def wait_for_page(
    page: Page, condition: Callable[[dict[str, Any]], bool], what: str, timeout: float = 20.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    view = shown(page)
    while not condition(view):
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {what}; it shows {view}")
        time.sleep(0.1)
        view = shown(page)
    return view


def rows(count: int) -> pa.Table:
    ids = pa.array(range(count), pa.int64())
    return pa.table({"id": ids, "pad": pa.array(["x" * 100] * count)})


def test_the_open_page_shows_a_new_node_and_a_migration(tmp_path: Path, chromium: Chromium) -> None:
    with shardflow.connect(
        workers=2,
        data_dir=tmp_path / "data",
        auto_balance=False,
        test_hold_copy_s=4,  # a move stays in flight for 4 s
    ) as db:
        db.create_table("events", rows(80_000), distributed_by="id")
        for _ in range(5):
            db.sql("SELECT count(*) FROM events")
        url = db.cluster.metrics_url().removesuffix("metrics")
        assert url.startswith("http://127.0.0.1:")
        page = chromium.open(url)
        page.evaluate("window.openedOnce = true")

        def placement() -> dict[str, str]:
            return {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}

        before = placement()
        view = wait_for_page(
            page,
            # query outcomes reach the coordinator in batches (every 0.25 s): wait for them
            lambda v: v["updates"] >= 1 and dict(v["shards"]) == before and v["qps"] > 0,
            "the two nodes' shards and the queries' rate",
        )
        assert [n["name"] for n in view["nodes"]] == ["node-0", "node-1"]
        assert all(n["alive"] == "yes" and n["device"].startswith("cpu") for n in view["nodes"])
        assert view["map_rows"] == ["node-0", "node-1"]
        assert view["qps"] > 0 and view["status"].startswith("as of")

        new = db.cluster.add_node()
        view = wait_for_page(
            page,
            lambda v: new in [n["name"] for n in v["nodes"]] and new in v["map_rows"],
            f"{new} joining",
        )
        assert new not in {node for _, node in view["shards"]}  # it holds nothing yet

        shard = sorted(before)[0]
        moved: list[shardflow.MigrationRecord] = []
        mover = threading.Thread(target=lambda: moved.append(db.cluster.migrate(shard, to=new)))
        mover.start()
        try:
            view = wait_for_page(page, lambda v: bool(v["moves"]), f"{shard} moving")
        finally:
            mover.join(timeout=120)
        [move] = view["moves"]
        assert move["shards"] == shard and move["to"] == new, move
        assert move["phase"] in IN_FLIGHT, move
        assert moved and moved[0].phase == "done"

        after = placement()
        assert after[shard] == new
        view = wait_for_page(
            page,
            lambda v: dict(v["shards"]) == after and not v["moves"],
            f"{shard} on {new}",
        )
        assert [n["name"] for n in view["nodes"]] == ["node-0", "node-1", new]
        assert view["opened_once"], "the page was reloaded"
        page.close()
