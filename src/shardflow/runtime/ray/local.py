"""This process's Ray: an embedded local Ray bound to 127.0.0.1 (started here, stopped with
the last database that uses it), or an existing Ray cluster joined by address."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray
from ray._common import utils as ray_utils
from ray._private import ray_constants
from ray._private import worker as ray_worker

from shardflow.config import LOOPBACK, Settings, is_loopback
from shardflow.errors import ConfigError
from shardflow.runtime.ray.names import NAMESPACE
from shardflow.runtime.ray.node import enable_token_auth, process_environment

if TYPE_CHECKING:
    from ray._private.node import Node

ray_log = logging.getLogger("shardflow.ray")
"""What Ray's cluster reports to this driver (see ``_keep_cluster_messages_off_stdout``)."""
_local_databases = 0
"""Open databases on the Ray instance this process started; it stops with the last one."""
_local_node: Node | None = None
"""The Ray node this process started for its embedded clusters."""


def start_ray(address: str | None, settings: Settings) -> bool:
    """Start or join Ray; returns True when the database uses a Ray instance this process
    started itself (and so must stop when the last such database closes)."""
    global _local_databases
    _keep_cluster_messages_off_stdout()
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        embedded = bool(_local_databases)
        if address is not None and (embedded or not _same_address(address, current)):
            where = "an embedded cluster" if embedded else f"the Ray cluster at {current}"
            raise ConfigError(
                f"this process is connected to {where}; a process joins one Ray cluster "
                f"(close its databases first, or connect to {address} from another process)"
            )
        if embedded:
            _local_databases += 1
            return True
        return False
    if address is None:
        _start_local_ray(settings)
        _local_databases = 1
        return True
    _use_auth_token_if_present()
    kwargs: dict[str, Any] = {
        "namespace": NAMESPACE,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    if is_loopback(address):  # a cluster of this machine (`shardflow cluster up`)
        _pin_to_loopback()
        kwargs["_node_ip_address"] = LOOPBACK
        folder = _folder_beside_head(address)
        if folder is not None:  # Ray would attach this driver to the head, and it would
            kwargs["_temp_dir"] = folder  # die with a head that dies (cluster up --ha)
    else:
        here = _own_node_address(address)
        if here is not None:  # a local cluster in network namespaces: the node on this side
            kwargs["_node_ip_address"] = here
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ConfigError(f"cannot join the Ray cluster at {address!r}: {error}") from None
    return False


def _folder_beside_head(address: str) -> str | None:
    """Ray's folder of this machine's data nodes of the cluster at ``address``, where its
    head has a folder of its own (a cluster that survives its head), else None. Ray attaches
    a driver to the head first among the raylets of the driver's folder; naming the data
    nodes' folder keeps drivers off the head. Read from the raylets' command lines (Linux:
    /proc), so that a cluster started with a folder of its own is joined as Ray would."""
    head: set[str] = set()
    others: set[str] = set()
    for arguments in _raylets(address):
        folders = [a.split("=", 1)[1] for a in arguments if a.startswith("--temp_dir=")]
        if folders:
            (head if "--head" in arguments else others).update(folders[:1])
    if not head or not others or head & others:
        return None
    default = str(ray_utils.get_default_ray_temp_dir())  # type: ignore[no-untyped-call]
    return default if default in others else sorted(others)[0]


def _own_node_address(address: str) -> str | None:
    """The address of this machine toward the head at ``address``, where a Ray node of that
    cluster runs on it (this process's namespace of a local cluster in network namespaces,
    ``tools/netns.py``): the driver attaches to that node, not one across a cut. None
    elsewhere (Ray finds its node as usual)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # chooses the route; sends nothing
            here = str(probe.getsockname()[0])
    except (OSError, ValueError):
        return None
    for arguments in _raylets(address):
        if f"--node_ip_address={here}" in arguments:
            return here
    return None


def _raylets(address: str) -> Iterator[list[str]]:
    """The command lines of the raylets of the cluster at ``address`` on this machine
    (Linux: read from /proc)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return
    for entry in entries:
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as raw:
                arguments = raw.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if arguments[0].endswith("raylet") and f"--gcs-address={address}" in arguments:
            yield arguments


def attached_node() -> str:
    """The Ray node id whose raylet this process's driver is attached to ("" when it has
    not joined Ray): a drill must not kill the node its own driver rides on."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def leave_ray() -> None:
    """Disconnect this process from the Ray cluster it joined (not one it started: that
    stops with its last database), a command being done with it: Ray's own exit handler
    would first wait half a second for log lines, which shardflow keeps in its log."""
    if ray.is_initialized() and not _local_databases:
        ray.shutdown()


def _keep_cluster_messages_off_stdout() -> None:
    """Ray prints what its cluster reports to every driver (a worker that died, a node
    lost) on the driver's standard output, in colour: over a program's own output, a
    ``--format json`` answer included. shardflow reports those events itself (failovers,
    metrics, the console), so in its drivers they go to its log instead, plain."""
    if getattr(ray_worker.print_to_stdstream, "shardflow", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        for line in data.get("lines", []):
            ray_log.info("(%s) %s", data.get("pid", "ray"), line)

    to_log.shardflow = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = to_log


def _start_local_ray(settings: Settings) -> None:
    """Start a new Ray instance for embedded clusters (never one `ray start` left behind)
    and connect this process to it. An embedded cluster serves this machine only: every
    server binds to 127.0.0.1, and token authentication is on, as in ``ray.init()``'s own
    local instances. The node is started here rather than by ``ray.init()`` to leave out
    two processes that serve nothing here but cost start-up time on a small machine
    (about a second of CPU together): the log monitor (worker logs are not sent to the
    driver) and the autoscaler's monitor (one machine, nothing to scale). Nor does it start
    Ray's API server (the dashboard process, which Ray starts even without its dashboard to
    serve usage statistics, and waits for): nothing of shardflow asks it anything, and its
    start was ~1.3 s of an embedded cluster's start here (``bench/startup.py``)."""
    global _local_node
    from ray._private.parameter import RayParams

    _pin_to_loopback()
    with _quiet("ray._private.authentication.authentication_token_setup"):
        enable_token_auth()  # "token authentication is enabled": as it should be
    params = RayParams(
        node_ip_address=LOOPBACK,
        num_cpus=max(os.cpu_count() or 1, 1),
        object_store_memory=settings.object_store_memory or None,
        include_dashboard=False,
        include_log_monitor=False,  # type: ignore[arg-type]  # a flag Ray annotates as str
        no_monitor=True,
    )
    with process_environment():
        node = _node_without_api_server()(
            params, head=True, shutdown_at_exit=False, spawn_reaper=True, ray_init_cluster=True
        )
    _local_node = node
    atexit.register(_stop_local_ray)  # a process that exits with databases open
    try:
        ray.init(
            address=node.gcs_address,
            _node_ip_address=LOOPBACK,
            namespace=NAMESPACE,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
    except BaseException:
        _stop_local_ray()
        raise


def _node_without_api_server() -> type[Node]:
    """Ray's head node class, less its API server process (see ``_start_local_ray``)."""
    from ray._private.node import Node

    class EmbeddedNode(Node):
        def start_api_server(
            self, *, include_dashboard: bool | None, raise_on_failure: bool
        ) -> None:
            self._webui_url = None  # what Ray records when its API server does not come up

    return EmbeddedNode


def _stop_local_ray() -> None:
    """Disconnect from the Ray instance this process started and stop its processes."""
    global _local_node
    node, _local_node = _local_node, None
    if node is None:
        return
    atexit.unregister(_stop_local_ray)
    if ray.is_initialized():
        ray.shutdown()
    node.destroy_external_storage()  # type: ignore[no-untyped-call]
    # waited for: a process object dropped while its process still runs warns
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


def _same_address(address: str, current: str) -> bool:
    if address == "auto":
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host == "localhost":
        host = LOOPBACK
    return f"{host}:{port}" == current


def _pin_to_loopback() -> None:
    """Make this process's Ray use 127.0.0.1 for itself and every node: with multi-node
    clusters allowed (Ray's default on Linux), Ray resolves 127.0.0.1 to the host's own
    network address and announces and dials that instead. Ray reads the switch when it is
    imported, so the loaded flag is set too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _use_auth_token_if_present() -> None:
    """Join a token-authenticated cluster (Ray's default) with the token this machine has;
    Ray only looks for it by itself when it starts a cluster."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    with _quiet(maybe_enable_token_auth_if_token_available.__module__):
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # see _quiet


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Only errors from these loggers meanwhile: Ray warns that token authentication is
    enabled, as it should be."""
    quieted = [logging.getLogger(name) for name in loggers]
    levels = [logger.level for logger in quieted]
    for logger in quieted:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(quieted, levels, strict=True):
            logger.setLevel(level)


def release_ray() -> None:
    """A database that used this process's Ray closed: stop Ray with the last of them."""
    global _local_databases
    _local_databases -= 1
    if _local_databases <= 0:
        _local_databases = 0
        if ray.is_initialized():
            _no_auto_init()
            ray.shutdown()
        _stop_local_ray()


def _no_auto_init() -> None:
    """Turn off Ray's auto-init in this process. Without it, a Ray call still in flight on
    another thread when shardflow shuts its Ray down would start a fresh, empty local Ray
    and wait on it for ever; with it off the call fails at once (and ends as a
    ``ClosedError``). shardflow always starts Ray itself. Ray reads the switch
    (``RAY_ENABLE_AUTO_CONNECT=0``) when it is imported, so the loaded flag is set too."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False
