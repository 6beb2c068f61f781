"""The service's door: who gets in, what each role may do, what is written down, and bad
input that must leave the server serving the others with nothing written."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import adbc_driver_flightsql.dbapi as flight_sql
import adbc_driver_manager
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import shardflow
from shardflow.errors import AuthenticationError, PermissionDeniedError
from shardflow.flightsql import wire as fsql
from tests.service.conftest import (
    PASSWORDS,
    Served,
    add_users,
    sample_table,
    shardflow_cli,
    start_service,
)

pytestmark = pytest.mark.cluster


def as_user(served: Served, user: str) -> shardflow.flightsql.client.RemoteDatabase:
    return shardflow.connect(served.uri, user=user, password=PASSWORDS[user])


def authenticated(served: Served, user: str = "alice") -> tuple[flight.FlightClient, object]:
    client = flight.FlightClient(served.uri)
    header = client.authenticate_basic_token(user, PASSWORDS[user])
    return client, flight.FlightCallOptions(headers=[header])


def metric(url: str, name: str, reaching: float | None = None) -> float:
    """A counter's value; with ``reaching``, once it got there (counts arrive
    asynchronously), or its value after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        lines = text.splitlines()
        value = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
        if reaching is None or value >= reaching or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_wrong_password_and_bad_tokens_are_refused_and_counted(served: Served) -> None:
    with as_user(served, "olga") as olga:
        url = olga.cluster.metrics_url()
    before = metric(url, "shardflow_auth_failures_total")
    with pytest.raises(AuthenticationError, match="wrong user name or password"):
        shardflow.connect(served.uri, user="alice", password="not-her-password")
    with pytest.raises(AuthenticationError, match="wrong user name or password"):
        shardflow.connect(served.uri, user="nobody", password="x")
    with pytest.raises(AuthenticationError, match="unknown or expired token"):
        shardflow.connect(served.uri, token="sft_" + secrets.token_urlsafe(32))
    with pytest.raises(adbc_driver_manager.Error, match="AuthenticationError"):
        flight_sql.connect(served.uri, db_kwargs={"username": "bob", "password": "nope"})
    client = flight.FlightClient(served.uri)  # no credentials at all
    with pytest.raises(flight.FlightUnauthenticatedError, match="authentication required"):
        client.list_actions()
    client.close()
    assert metric(url, "shardflow_auth_failures_total", before + 5) >= before + 5
    refused = [e for e in audit(served) if e["action"] == "authenticate"]
    assert any(e["who"] == "alice" and e["outcome"].startswith("refused") for e in refused)


def test_service_tokens_work_until_revoked_or_expired(served: Served) -> None:
    data_dir = str(served.data_dir)
    made = shardflow_cli("token", "create", "--role", "reader", "--name", "etl", "--data-dir",
                         data_dir)  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    token = made.stdout.strip().splitlines()[-1]
    with shardflow.connect(served.uri, token=token) as db:
        assert db.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000
        with pytest.raises(PermissionDeniedError, match="needs role writer"):
            db.insert("t", sample_table(1))
    header = {"adbc.flight.sql.authorization_header": f"Bearer {token}"}
    with flight_sql.connect(served.uri, db_kwargs=header, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.execute("SELECT max(id) FROM t")
            assert cur.fetchall() == [(1999,)]
    assert shardflow_cli("token", "revoke", "etl", "--data-dir", data_dir).returncode == 0
    with pytest.raises(AuthenticationError):
        shardflow.connect(served.uri, token=token)
    short = shardflow_cli("token", "create", "--role", "reader", "--ttl", "1", "--data-dir",
                          data_dir)  # fmt: skip
    brief = short.stdout.strip().splitlines()[-1]
    time.sleep(1.5)
    with pytest.raises(AuthenticationError, match="expired"):
        shardflow.connect(served.uri, token=brief)


def snapshot(served: Served) -> tuple[list[dict[str, object]], list[str], int]:
    with as_user(served, "olga") as olga:
        shards = sorted(olga.cluster.shards().to_pylist(), key=lambda r: str(r["shard"]))
        tables = olga.tables()["name"].to_pylist()
        rows = olga.sql("SELECT count(*) AS n FROM t")["n"][0].as_py()
    for shard in shards:
        shard.pop("load", None)
    return shards, tables, rows


def test_roles_guard_every_change_and_a_denied_call_changes_nothing(served: Served) -> None:
    with as_user(served, "olga") as olga:
        url = olga.cluster.metrics_url()
        shard = olga.cluster.shards()["shard"][0].as_py()
        nodes = [n.node_id for n in olga.cluster.nodes()]
    denied_before = metric(url, 'shardflow_denied_total{action="migrate"}')
    before = snapshot(served)
    with as_user(served, "alice") as alice:
        for attempt in (
            lambda: alice.cluster.migrate(shard, nodes[-1]),
            lambda: alice.cluster.split(shard),
            lambda: alice.cluster.drain(nodes[0]),
            lambda: alice.cluster.drain_host("any-ray-node"),
            lambda: alice.cluster.rebalance(dry_run=False),
            lambda: alice.cluster.cancel("any-move"),
            lambda: alice.cluster.pause_balancer(),
            lambda: alice.cluster.nodes(),
            lambda: alice.insert("t", sample_table(5)),
            lambda: alice.drop_table("t"),
            lambda: alice.sql("DROP TABLE t"),
            lambda: alice.sql("INSERT INTO t SELECT * FROM t"),
            lambda: alice.create_table("t2", sample_table(5)),
        ):
            with pytest.raises(PermissionDeniedError, match=r"needs role (writer|operator)"):
                attempt()
        assert alice.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000  # reads: yes
    with as_user(served, "bob") as bob:
        with pytest.raises(PermissionDeniedError, match="migrate needs role operator"):
            bob.cluster.migrate(shard, nodes[-1])
    assert snapshot(served) == before
    name = 'shardflow_denied_total{action="migrate"}'
    assert metric(url, name, denied_before + 2) == denied_before + 2
    denied = [e for e in audit(served) if e["outcome"].startswith("denied")]
    migrate = [e for e in denied if e["action"] == "migrate"]
    assert {e["who"] for e in migrate} >= {"alice", "bob"}
    assert migrate[-1]["arguments"] == {"shard": shard, "to": nodes[-1]}


def test_control_operations_are_audited_and_the_cli_prints_them(served: Served) -> None:
    with as_user(served, "olga") as olga:
        shards = olga.cluster.shards()
        shard = shards["shard"][0].as_py()
        record = olga.cluster.split(shard)
        assert record.phase == "done"
    entry = next(e for e in reversed(audit(served)) if e["action"] == "split")
    assert entry["who"] == "olga" and entry["outcome"] == "ok"
    assert entry["arguments"] == {"shard": shard} and entry["duration_s"] > 0
    printed = shardflow_cli("audit", "--since", "10m", "--data-dir", str(served.data_dir))
    assert printed.returncode == 0, printed.stdout + printed.stderr
    assert "split" in printed.stdout and "olga" in printed.stdout


def audit(served: Served) -> list[dict[str, object]]:
    shown = shardflow_cli("audit", "--json", "--data-dir", str(served.data_dir))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return [json.loads(line) for line in shown.stdout.splitlines() if line.strip()]


# -- bad input --------------------------------------------------------------------------------
def test_malformed_commands_foreign_tickets_and_unknown_actions(served: Served) -> None:
    client, options = authenticated(served)
    for command in (b"\xff\x00garbage", fsql.pack(fsql.new("DoPutUpdateResult"))):
        with pytest.raises((pa.ArrowInvalid, pa.ArrowNotImplementedError)):
            client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
    with pytest.raises(pa.ArrowInvalid, match="not paths"):
        client.get_flight_info(flight.FlightDescriptor.for_path("t"), options)
    foreign = fsql.pack(fsql.new("TicketStatementQuery", statement_handle=secrets.token_bytes(16)))
    with pytest.raises(pa.ArrowKeyError, match="unknown or expired ticket"):
        client.do_get(flight.Ticket(foreign), options).read_all()
    with pytest.raises(pa.ArrowInvalid, match="not a ticket"):
        client.do_get(flight.Ticket(b"random bytes"), options).read_all()
    with pytest.raises(pa.ArrowInvalid, match="unknown action"):
        list(client.do_action(flight.Action("format_disk", b""), options))
    olga, olga_options = authenticated(served, "olga")
    with pytest.raises(pa.ArrowInvalid, match="JSON object"):
        list(olga.do_action(flight.Action("migrate", b"{not json"), olga_options))
    with pytest.raises(pa.ArrowInvalid, match="needs 'to'"):
        list(olga.do_action(flight.Action("migrate", b'{"shard": "t#0"}'), olga_options))
    assert_serving(served)
    client.close()
    olga.close()


def test_a_huge_request_is_refused_and_keeps_nothing(served: Served) -> None:
    client, options = authenticated(served, "bob")
    huge = b"\x00" * (64 << 20)  # a 64 MiB command: refused unread, not parsed
    with pytest.raises(pa.ArrowInvalid, match="too large"):
        client.get_flight_info(flight.FlightDescriptor.for_command(huge), options)
    # a 1 GiB bulk ingest, streamed: refused past max_request_mb, nothing of it kept
    command = fsql.new("CommandStatementIngest", table="t")
    command.table_definition_options.if_not_exist = fsql.IF_NOT_EXIST["FAIL"]
    command.table_definition_options.if_exists = fsql.IF_EXISTS["APPEND"]
    batch = sample_table(1 << 15).to_batches()[0]
    descriptor = flight.FlightDescriptor.for_command(fsql.pack(command))
    writer, _ = client.do_put(descriptor, batch.schema, options)
    sent = 0
    with pytest.raises(pa.ArrowException, match="max_request_mb"):
        while sent < 1 << 30:
            writer.write_batch(batch)
            sent += batch.nbytes
        writer.done_writing()
        writer.close()
    assert_serving(served)
    client.close()


def test_a_client_that_disconnects_mid_stream_leaves_the_server_serving(served: Served) -> None:
    with as_user(served, "olga") as olga:
        if "wide" not in olga.tables()["name"].to_pylist():
            olga.create_table(
                "wide", pa.table({"v": np.arange(2_000_000, dtype=np.int64)}), distributed_by="v"
            )
    client, options = authenticated(served)
    command = fsql.pack(fsql.new("CommandStatementQuery", query="SELECT v, v * 2 AS w FROM wide"))
    info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
    reader = client.do_get(info.endpoints[0].ticket, options)
    first = reader.read_chunk()
    assert first.data.num_rows > 0
    client.close()  # gone mid-stream
    assert_serving(served)


def test_fifty_concurrent_clients_each_get_their_answer(served: Served) -> None:
    def one(i: int) -> int:
        client, options = authenticated(served, ("alice", "bob", "olga")[i % 3])
        query = f"SELECT count(*) AS n FROM t WHERE id % 50 = {i}"
        descriptor = flight.FlightDescriptor.for_command(
            fsql.pack(fsql.new("CommandStatementQuery", query=query))
        )
        info = client.get_flight_info(descriptor, options)
        table = client.do_get(info.endpoints[0].ticket, options).read_all()
        client.close()
        return int(table["n"][0].as_py())

    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(one, range(50)))
    assert answers == [40] * 50


def assert_serving(served: Served) -> None:
    assert served.process.poll() is None, "".join(served.output[-30:])
    with as_user(served, "alice") as alice:
        assert alice.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000


# -- the network door -------------------------------------------------------------------------
def test_a_non_loopback_host_needs_tls_or_insecure(tmp_path: Path) -> None:
    refused = shardflow_cli("serve", "--host", "0.0.0.0", "--flight-port", "0", "--data-dir",
                            str(tmp_path))  # fmt: skip
    assert refused.returncode == 2
    assert "without TLS" in refused.stdout and "--insecure" in refused.stdout
    assert not (tmp_path / "catalog").exists()  # refused before anything started


def self_signed(directory: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert, private = directory / "cert.pem", directory / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, private


def test_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    data_dir = tmp_path / "data"
    add_users(data_dir)
    service = start_service(data_dir, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert service.uri.startswith("grpc+tls://127.0.0.1:")
        with shardflow.connect(
            service.uri, user="bob", password=PASSWORDS["bob"], tls_root_certs=cert.read_bytes()
        ) as db:
            db.create_table("secure", pa.table({"a": [1, 2, 3]}))
            assert db.sql("SELECT sum(a) AS s FROM secure")["s"][0].as_py() == 6
        plain = service.uri.replace("grpc+tls://", "grpc+tcp://")
        with pytest.raises(shardflow.ClusterError):  # a plain client cannot talk to it at all
            shardflow.connect(plain, user="bob", password=PASSWORDS["bob"])
        untrusted = flight.FlightClient(service.uri)  # the system's roots do not know it
        with pytest.raises(flight.FlightError):
            untrusted.authenticate_basic_token("bob", PASSWORDS["bob"])
        untrusted.close()
    finally:
        assert service.stop() == 0


def test_a_reader_cannot_write_through_adbc_statements(served: Served) -> None:
    """ADBC prepares every statement: the prepared path checks roles as the text path."""
    conn = flight_sql.connect(
        served.uri, db_kwargs={"username": "alice", "password": PASSWORDS["alice"]},
        autocommit=True,
    )  # fmt: skip
    with conn, conn.cursor() as cur:
        for statement, parameters in (
            ("INSERT INTO t SELECT * FROM t", None),
            ("INSERT INTO t (id, g) VALUES (?, ?)", (99_999, 1)),
            ("DROP TABLE t", None),
            ("CREATE TABLE copy_of_t AS SELECT * FROM t", None),
        ):
            with pytest.raises(adbc_driver_manager.Error, match="needs role writer"):
                cur.execute(statement, parameters=parameters)
    assert_serving(served)  # t still has its 2000 rows
    with as_user(served, "alice") as alice:
        assert "copy_of_t" not in alice.tables()["name"].to_pylist()


def test_sql_cannot_read_the_servers_files(served: Served) -> None:
    users = served.data_dir / "auth" / "users.json"
    assert users.exists()
    with as_user(served, "olga") as olga:
        for query in (
            f"SELECT * FROM read_text('{users}')",
            f"SELECT * FROM read_csv('{users}')",
            "SELECT * FROM glob('/etc/*')",
        ):
            with pytest.raises(shardflow.QueryError, match="not files"):
                olga.sql(query)


def no_stack(message: str) -> None:
    """A client learns shardflow's error class and message, never the server's stack."""
    for secret in ("Traceback", 'File "', ".py", "line "):
        assert secret not in message, message


def test_errors_reach_clients_without_the_servers_traceback(served: Served) -> None:
    """The README's ADBC example run twice (its table exists the second time), a query of
    a table that is not there, a command the server does not know: each error names
    shardflow's class and says what to do, and carries no path or stack of the server."""
    with flight_sql.connect(
        served.uri,
        db_kwargs={"username": "bob", "password": PASSWORDS["bob"]},
        autocommit=True,
    ) as writer:
        with writer.cursor() as cur:
            cur.adbc_ingest("twice", sample_table(3), mode="create")
            with pytest.raises(adbc_driver_manager.ProgrammingError) as exists:
                cur.adbc_ingest("twice", sample_table(3), mode="create")
            with pytest.raises(adbc_driver_manager.ProgrammingError) as unknown:
                cur.execute("SELECT * FROM not_there")
    said = str(exists.value)
    assert "TableExistsError: table twice exists" in said and "mode 'append'" in said, said
    assert "UnknownTableError" in str(unknown.value)
    client, options = authenticated(served)
    with pytest.raises(pa.ArrowInvalid) as action:
        list(client.do_action(flight.Action("format_disk", b""), options))
    with pytest.raises(pa.ArrowInvalid) as path:
        client.get_flight_info(flight.FlightDescriptor.for_path("t"), options)
    client.close()
    for error in (exists.value, unknown.value, action.value, path.value):
        no_stack(str(error))
    with as_user(served, "olga") as olga:
        olga.drop_table("twice")


def test_removing_a_user_ends_their_live_session_at_its_next_call(served: Served) -> None:
    """Revocation that bites: a session keeps querying while its user is removed; its next
    call is refused, and a login with the old password too."""
    data_dir = str(served.data_dir)
    made = shardflow_cli("user", "add", "dora", "--role", "reader", "--password-stdin",
                         "--data-dir", data_dir, stdin="dora-pass\n")  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    with shardflow.connect(served.uri, user="dora", password="dora-pass") as db:
        for _ in range(3):
            assert db.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000
        removed = shardflow_cli("user", "remove", "dora", "--data-dir", data_dir)
        assert removed.returncode == 0, removed.stdout + removed.stderr
        with pytest.raises(AuthenticationError):
            db.sql("SELECT count(*) AS n FROM t")
    with pytest.raises(AuthenticationError):
        shardflow.connect(served.uri, user="dora", password="dora-pass")


SERVER_STATE_QUERIES = [
    "SELECT name, value FROM duckdb_settings()",
    "SELECT current_setting('temp_directory') AS d",
    "SELECT * FROM pragma_database_size()",
    "SELECT path FROM duckdb_databases()",
    "SELECT version() AS v",
    "SELECT count(*) AS n FROM t WHERE s IN (SELECT value FROM duckdb_settings())",
]


@pytest.mark.parametrize("query", SERVER_STATE_QUERIES)
def test_the_servers_own_state_is_an_operators_only(served: Served, query: str) -> None:
    """Nothing of the server for readers and writers: its settings (with their paths),
    databases and versions are refused whole, naming the role needed; an operator reads
    them. (With the check switched off, readers and writers were answered.)"""
    for user in ("alice", "bob"):
        with as_user(served, user) as db:
            with pytest.raises(PermissionDeniedError, match="server state needs role operator"):
                db.sql(query)
    with as_user(served, "olga") as olga:
        assert olga.sql(query).num_rows >= 1
    refused = [e for e in audit(served) if e["action"] == "server state"]
    assert any(e["who"] == "alice" and e["outcome"] == "denied: needs operator" for e in refused)
