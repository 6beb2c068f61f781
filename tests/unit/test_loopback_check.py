"""The loopback proof of the multi-node tests must be able to fail: fed ``ss`` lines of
sockets off loopback (a dial to the host's own address, a listener on every interface), it
flags them; loopback sockets and other processes' sockets pass."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster import test_multinode
from tests.cluster.test_multinode import non_loopback_sockets

LINES = [
    'ESTAB 0 0 127.0.0.1:41986 127.0.0.1:33093 users:(("python",pid=11,fd=16))',
    'LISTEN 0 4096 [::ffff:127.0.0.1]:38047 *:* users:(("raylet",pid=12,fd=40))',
    'ESTAB 0 0 [::ffff:10.1.2.3]:50580 [::ffff:10.1.2.3]:42873 users:(("gcs",pid=13,fd=5))',
    'LISTEN 0 4096 *:42873 *:* users:(("raylet",pid=14,fd=41))',
    'LISTEN 0 128 0.0.0.0:2024 0.0.0.0:* users:(("sshd",pid=99,fd=3))',
]


def test_sockets_off_loopback_are_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_ss(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 0, stdout="\n".join(LINES))

    monkeypatch.setattr(test_multinode.subprocess, "run", fake_ss)
    assert non_loopback_sockets({11, 12}) == []
    flagged = non_loopback_sockets({11, 12, 13, 14})
    assert flagged == [LINES[2], LINES[3]]  # pid 99 is not ours
