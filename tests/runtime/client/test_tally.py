"""Query outcomes and inserted rows reach the coordinator in batches, and never after the
session closed (a call into Ray after it shut down takes the whole process down)."""

from __future__ import annotations

import time

import pytest

from shardflow.runtime.client import tally as tally_module
from shardflow.runtime.client.tally import Tally


def test_outcomes_are_sent_in_batches_and_nothing_after_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tally_module, "TALLY_INTERVAL_S", 0.05)
    sent: list[list[tuple[float, bool]]] = []
    rows: list[list[int]] = []
    tally = Tally(lambda queries, inserts: (sent.append(queries), rows.append(inserts)))
    for i in range(100):
        tally.query(0.001 * i, i % 10 != 0)
        tally.insert(i)
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sent) == 1 and len(sent[0]) == 100, "one call for the hundred queries"
    assert sum(not ok for _, ok in sent[0]) == 10
    assert rows == [list(range(100))]
    tally.query(0.5, True)
    tally.close()  # what is pending goes now
    assert sent[-1] == [(0.5, True)]
    tally.query(0.7, False)  # a call that was in flight at close ends after it
    tally.insert(3)
    tally.flush()
    time.sleep(0.2)
    assert sent[-1] == [(0.5, True)] and len(sent) == 2
