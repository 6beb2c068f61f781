"""The ``shardflow`` command: the demo, SQL against a data directory, the cluster and its
nodes, the network service and its accounts. One module per command group; errors are one
readable line and exit code 2."""

from __future__ import annotations

import sys

from shardflow.cli import backups, cluster, data, service
from shardflow.cli.common import app, console
from shardflow.errors import Error

__all__ = ["app", "backups", "cluster", "data", "main", "service"]


def main() -> None:
    try:
        app()
    except Error as error:
        # one line however long: a wrapped message reads as several errors
        console.print(f"[red]error:[/red] {type(error).__name__}: {error}", soft_wrap=True)
        raise SystemExit(2) from None
    finally:
        _leave_ray()


def _leave_ray() -> None:
    """Leave the Ray cluster a command joined, now (at exit Ray waits half a second)."""
    if "ray" in sys.modules:  # a command that never touched Ray does not load it now
        from shardflow.runtime.ray.local import leave_ray

        leave_ray()
