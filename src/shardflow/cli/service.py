"""The network service and its accounts: ``shardflow serve`` (Arrow Flight SQL, or a
detached service on a Ray cluster), users, service tokens, the audit log, and the
Kubernetes operator. Accounts and the audit log are files under the data directory: no Ray,
no running service needed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from shardflow.cli.common import (
    SERVICE_FILE,
    DataDir,
    ServiceDir,
    Sets,
    app,
    console,
    ray_database,
    start_service,
)
from shardflow.errors import ConfigError

if TYPE_CHECKING:
    from shardflow.service.auth import AuthStore


@app.command()
def serve(
    address: Annotated[
        str | None,
        typer.Option(help="The Ray cluster's address (host:port); none: an embedded one."),
    ] = None,
    data_dir: ServiceDir = Path(".shardflow"),
    workers: Annotated[
        int | None, typer.Option(min=1, max=64, help="Workers (default: one per Ray node).")
    ] = None,
    flight_port: Annotated[
        int | None,
        typer.Option(
            min=0, max=65535, help="Serve Arrow Flight SQL on this port (0: any free one)."
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address the Flight SQL server binds (loopback by default).")
    ] = "127.0.0.1",
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate: serve Flight SQL over TLS.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    insecure: Annotated[
        bool,
        typer.Option("--insecure", help="Allow a non-loopback --host without TLS."),
    ] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the running service.")] = False,
    operator_token_file: Annotated[
        Path | None,
        typer.Option(
            help="A file holding a service token (e.g. a mounted Kubernetes Secret) to accept "
            "as the operator-role token named 'k8s-operator'."
        ),
    ] = None,
    assignments: Sets = None,
) -> None:
    """Run shardflow as a service. With --flight-port, serve Arrow Flight SQL (ADBC, JDBC,
    pyarrow.flight, shardflow.connect("grpc://...")) until stopped (Ctrl-C, SIGTERM), on an
    embedded cluster or the Ray cluster at --address. With only --address, start a
    detached service there and return; connect(address=..., data_dir=...) attaches."""
    if stop:
        if address is None:
            raise typer.BadParameter("--stop needs --address")
        from shardflow.runtime.ray.bootstrap import stop_service

        stopped = stop_service(address, str(data_dir.absolute()))
        console.print(f"stopped the service of {data_dir.absolute()} ({len(stopped)} node ids)")
        return
    if flight_port is None:
        if address is None:
            raise typer.BadParameter("give --flight-port, --address, or both")
        start_service(address, data_dir, workers, assignments)
        return
    if operator_token_file is not None:
        _accept_operator_token(data_dir, operator_token_file)
    _serve_flight(address, data_dir, workers, assignments, flight_port, host, tls_cert, tls_key,
                  insecure)  # fmt: skip


OPERATOR_TOKEN_NAME = "k8s-operator"


def _accept_operator_token(data_dir: Path, path: Path) -> None:
    try:
        token = path.read_text().strip()
    except OSError as error:
        raise typer.BadParameter(f"cannot read --operator-token-file: {error}") from None
    _auth_store(data_dir).put_service_token(OPERATOR_TOKEN_NAME, "operator", token)


def _serve_flight(
    address: str | None,
    data_dir: Path,
    workers: int | None,
    assignments: list[str] | None,
    port: int,
    host: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    insecure: bool,
) -> None:
    from shardflow.audit import AuditLog
    from shardflow.config import Settings
    from shardflow.service.auth import AuthStore
    from shardflow.service.main import serve_flight, service_options

    settings = Settings().with_text(assignments or [])
    if tls_cert is not None and tls_key is not None and not settings.endpoint_tls_cert:
        # the workers' endpoints speak TLS with the service's own certificate
        settings = settings.replace(
            endpoint_tls_cert=str(tls_cert.absolute()), endpoint_tls_key=str(tls_key.absolute())
        )
    options = service_options(
        host, port, tls_cert, tls_key, insecure, settings.token_ttl_s,
        settings.max_request_mb << 20, settings.audit_max_mb << 20,
        settings.audit_max_days * 86400.0,
    )  # fmt: skip
    AuditLog(data_dir).check_private()  # before a cluster starts
    if not AuthStore(data_dir).users() and not AuthStore(data_dir).service_tokens():
        console.print(
            "[yellow]no users yet: add one with shardflow user add NAME --role operator "
            f"--data-dir {data_dir} (the service reads them as they are added)"
        )
    with console.status("starting the cluster"):
        db = ray_database(address, data_dir, workers=workers, settings=settings)
    record_file = data_dir / SERVICE_FILE
    try:
        if address is not None:
            db.keep_running()  # the cluster keeps serving when this door closes

        def ready(server: Any) -> None:
            # the data commands of this data directory say where the door is
            record = {"location": server.location, "pid": os.getpid()}
            partial = record_file.with_suffix(".partial")
            partial.write_text(json.dumps(record))
            partial.replace(record_file)
            console.print(f"shardflow serves {data_dir.absolute()}")
            print(f"Flight SQL on {server.location}", flush=True)  # one line, never wrapped

        serve_flight(db, str(data_dir.absolute()), options, ready)
    finally:
        record_file.unlink(missing_ok=True)
        db.close()
    console.print("Flight SQL service stopped")


user_app = typer.Typer(help="Users of the Flight SQL service (name, role, password).")
token_app = typer.Typer(help="Service tokens: bearer tokens for machines, shown once.")
app.add_typer(user_app, name="user", no_args_is_help=True)
app.add_typer(token_app, name="token", no_args_is_help=True)
Role = Annotated[
    str, typer.Option(help="reader, writer or operator (each includes the ones before).")
]


def _auth_store(data_dir: Path) -> AuthStore:
    from shardflow.service.auth import AuthStore

    return AuthStore(data_dir)


@user_app.command("add")
def user_add(
    name: Annotated[str, typer.Argument(help="Login name: letters, digits and _.@- (1-64).")],
    role: Role,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="Read the password from standard input.")
    ] = False,
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Add a user; the password is asked for (twice), or read from standard input."""
    from shardflow.service.auth import check_role

    check_role(role)  # before asking for a password that would be refused anyway
    if password_stdin:
        text = sys.stdin.read()
        password = text.removesuffix("\n").removesuffix("\r")
    else:
        password = typer.prompt("Password", hide_input=True, confirmation_prompt=True)
    _auth_store(data_dir).add_user(name, role, password)
    console.print(f"added user {name} ({role})")


@user_app.command("list")
def user_list(data_dir: DataDir = Path(".shardflow")) -> None:
    """The users: name, role, when created."""
    view = Table("name", "role", "created")
    for user in _auth_store(data_dir).users():
        view.add_row(user["name"], user["role"], user["created"])
    console.print(view)


@user_app.command("remove")
def user_remove(
    name: Annotated[str, typer.Argument(help="The user to remove.")],
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Remove a user."""
    _auth_store(data_dir).remove_user(name)
    console.print(f"removed user {name}")


@token_app.command("create")
def token_create(
    role: Role,
    name: Annotated[str | None, typer.Option(help="The token's name (default: svc-<hex>).")] = None,
    ttl: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds it is valid (default: until revoked).")
    ] = None,
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Create a service token; the token is the last line printed (and only shown now)."""
    name, token = _auth_store(data_dir).create_service_token(role, name=name, ttl_s=ttl)
    console.print(
        f"service token {name} ({role}); store it now, it is shown only once:", highlight=False
    )
    print(token)  # alone on the last line, unwrapped: scripts capture it


@token_app.command("list")
def token_list(data_dir: DataDir = Path(".shardflow")) -> None:
    """The service tokens: name, role, created, expires (never the tokens themselves)."""
    from datetime import datetime

    view = Table("name", "role", "created", "expires")
    for token in _auth_store(data_dir).service_tokens():
        expires = "never"
        if token["expires"] is not None:
            expires = datetime.fromisoformat(token["expires"]).isoformat(timespec="seconds")
        if token["expired"]:
            expires += " (expired)"
        view.add_row(token["name"], token["role"], token["created"], expires)
    console.print(view)


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="The token's name (see token list).")],
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """Revoke a service token: it is refused from its next request on."""
    _auth_store(data_dir).revoke_token(name)
    console.print(f"revoked service token {name}")


@app.command()
def audit(
    check: Annotated[
        str | None,
        typer.Argument(
            help="verify: check the hash chain of every audit file, and say where "
            "it breaks (exit code 2)"
        ),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Entries from this age (30s, 10m, 2h, 1d) or ISO time on.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, as stored.")] = False,
    data_dir: DataDir = Path(".shardflow"),
) -> None:
    """The audit log of the network service: who did what, with which outcome
    (`shardflow audit verify`: whether any line was removed, edited or moved)."""
    from shardflow.audit import AuditLog
    from shardflow.service.auth import parse_since

    if check is not None:
        if check != "verify":
            raise ConfigError(f"`shardflow audit` takes verify or nothing, not {check!r}")
        log = AuditLog(data_dir)
        found = log.verify()
        files = len(log.files())
        torn = f", {found.torn} line(s) torn by a crash skipped" if found.torn else ""
        if found.broken is not None:
            raise ConfigError(f"the audit log's chain breaks at {found.broken}")
        console.print(f"{found.entries} entries in {files} file(s), the chain intact{torn}")
        return
    start = parse_since(since) if since is not None else None
    entries = AuditLog(data_dir).entries(since=start)
    if as_json:
        for entry in entries:
            print(json.dumps(entry, ensure_ascii=False))
        return
    if not entries:
        console.print("no audit entries" + (f" since {start.isoformat()}" if start else ""))
        return
    view = Table("time", "who", "action", "arguments", "outcome", "ms")
    for entry in entries:
        cells = (
            str(entry.get("time")),
            str(entry.get("who")),
            str(entry.get("action")),
            json.dumps(entry.get("arguments"), ensure_ascii=False),
            str(entry.get("outcome")),
            f"{float(entry.get('duration_s') or 0) * 1000:.1f}",
        )
        view.add_row(*(Text(cell) for cell in cells))  # Text: "[...]" in SQL is not markup
    console.print(view)


@app.command()
def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option(help="Watch this namespace (repeatable); none: the whole cluster."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Log at debug level.")] = False,
) -> None:
    """Run the Kubernetes operator (ShardflowCluster, ShardMigration) until stopped; it needs
    the k8s extra: pip install 'shardflow\\[k8s]'. See docs/kubernetes.md."""
    try:
        from shardflow.k8s import operator as k8s_operator
    except ImportError as error:
        raise ConfigError(
            f"the operator needs the k8s extra (pip install 'shardflow[k8s]'): {error}"
        ) from None
    k8s_operator.run(namespace or [], verbose)
