"""``shardflow serve --flight-port``: a cluster behind the Flight SQL door, until stopped."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardflow.config import is_loopback
from shardflow.errors import ConfigError
from shardflow.service.server import FlightSqlService, ServiceOptions


def service_options(
    host: str,
    port: int,
    tls_cert: Path | None,
    tls_key: Path | None,
    insecure: bool,
    token_ttl_s: float,
    max_request_bytes: int = ServiceOptions.max_request_bytes,
    audit_max_bytes: int = ServiceOptions.audit_max_bytes,
    audit_max_age_s: float = ServiceOptions.audit_max_age_s,
) -> ServiceOptions:
    """Checked options: TLS needs both files; a host other than loopback needs TLS
    (or ``insecure``, said out loud)."""
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    if tls_cert is None and not is_loopback(f"{host}:0") and not insecure:
        raise ConfigError(
            f"refusing to serve {host} without TLS: passwords and data would cross the "
            "network in the clear. Give --tls-cert/--tls-key, or --insecure to do it anyway"
        )
    if port:
        _require_free(host, port)
    cert = key = None
    if tls_cert is not None and tls_key is not None:
        try:
            cert, key = tls_cert.read_bytes(), tls_key.read_bytes()
        except OSError as error:
            raise ConfigError(f"cannot read the TLS certificate or key: {error}") from None
    return ServiceOptions(
        host=host,
        port=port,
        tls_cert=cert,
        tls_key=key,
        token_ttl_s=token_ttl_s,
        max_request_bytes=max_request_bytes,
        audit_max_bytes=audit_max_bytes,
        audit_max_age_s=audit_max_age_s,
    )


def _require_free(host: str, port: int) -> None:
    """Say at once, before any cluster starts, that ``host:port`` is taken (the Flight
    server would only fail once everything else was up, in gRPC's words)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise ConfigError(f"cannot serve on {host}: {error}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as error:
            raise ConfigError(
                f"{host}:{port} is in use ({error.strerror}): stop what listens there, or "
                "choose another --flight-port (0: any free one)"
            ) from None


def serve_flight(
    db: Any,
    data_dir: str,
    options: ServiceOptions,
    ready: Callable[[FlightSqlService], None] | None = None,
) -> None:
    """Serve ``db`` until SIGINT or SIGTERM, then stop taking calls (the caller closes
    ``db``)."""
    server = FlightSqlService(db, data_dir, options)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ready is not None:
            ready(server)
        stop.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        server.shutdown()
