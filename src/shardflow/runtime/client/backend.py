"""The session's backend on Ray: the actors ``runtime/ray/bootstrap.py`` started or found,
the Ray calls that leave a query's fragment results in the object store, and workers added
on the Ray node holding the fewest of this process's."""

from __future__ import annotations

from collections.abc import Mapping

from shardflow.config import Settings
from shardflow.errors import ConfigError
from shardflow.runtime.client.ray_calls import RayCalls
from shardflow.runtime.protocol import Coordinator, Worker, Workers
from shardflow.runtime.ray.bootstrap import ClusterHandle, launch, next_slot, shutdown, start_worker


class RayBackend:
    """A cluster on Ray, as a session uses it."""

    def __init__(self, handle: ClusterHandle) -> None:
        self.handle = handle

    @property
    def settings(self) -> Settings:
        return self.handle.settings

    @property
    def data_dir(self) -> str:
        return self.handle.data_dir

    @property
    def coordinator(self) -> Coordinator:
        return self.handle.coordinator

    @property
    def workers(self) -> Workers:
        return self.handle.workers

    def fragment_calls(self) -> RayCalls:
        return RayCalls(self.handle.workers)

    def start_worker(self, node: str, slowdown: float) -> Worker:
        return start_worker(self.handle, node, next_slot(self.handle), slowdown)

    def leave_running(self) -> None:
        """Leave the actors running at :meth:`close` (a service on a Ray cluster joined by
        address: its actors are detached, and outlive the process that started them)."""
        if not self.handle.spawner.detached:
            raise ConfigError(
                "an embedded cluster stops with the process that started it; only a cluster "
                "on a Ray cluster joined by address (connect(address=...)) keeps running"
            )
        self.handle.owns_actors = False

    def close(self) -> None:
        """Stop what :func:`launch_on_ray` started (see ``bootstrap.shutdown``)."""
        shutdown(self.handle)


def launch_on_ray(
    address: str | None,
    workers: int | None,
    data_dir: str,
    settings: Settings,
    simulate: Mapping[str, float] | None = None,
) -> RayBackend:
    """Start (or attach to) the cluster serving ``data_dir``: an embedded local Ray with
    ``workers`` workers when ``address`` is None, else the Ray cluster at ``address``."""
    return RayBackend(launch(address, workers, data_dir, settings, simulate))
