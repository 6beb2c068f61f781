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
import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import shardflow
from shardflow.errors import AuthenticationError, PermissionDeniedError
from shardflow.flightsql import wire as fsql
from shardflow.service.auth import AuthStore
from tests.service.conftest import (
    PASSWORDS,
    Served,
    add_users,
    sample_table,
    self_signed,
    shardflow_cli,
    start_service,
)

pytestmark = pytest.mark.cluster


def as_user(served: Served, user: str) -> shardflow.flightsql.client.RemoteDatabase:
    password = PASSWORDS.get(user, f"{user}-pass")  # made by add_user below
    return shardflow.connect(served.uri, user=user, password=password)


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
            lambda: alice.cluster.backup(str(served.data_dir / "stolen")),
            lambda: alice.cluster.nodes(),
            lambda: alice.insert("t", sample_table(5)),
            lambda: alice.drop_table("t"),
            lambda: alice.sql("DROP TABLE t"),
            lambda: alice.sql("INSERT INTO t SELECT * FROM t"),
            lambda: alice.sql("TRUNCATE t"),
            lambda: alice.create_table("t2", sample_table(5)),
        ):
            with pytest.raises(PermissionDeniedError, match=r"needs role (writer|operator)"):
                attempt()
        assert alice.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000  # reads: yes
    with as_user(served, "bob") as bob:
        with pytest.raises(PermissionDeniedError, match="migrate needs role operator"):
            bob.cluster.migrate(shard, nodes[-1])
    assert snapshot(served) == before
    assert not (served.data_dir / "stolen").exists()
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
            olga.sql("GRANT SELECT ON wide TO reader")
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
            ("TRUNCATE t", None),
            ("CREATE TABLE copy_of_t AS SELECT * FROM t", None),
            ("WITH x AS (SELECT 1 AS id) DELETE FROM t WHERE id IN (SELECT id FROM x)", None),
            ("UPDATE t SET g = 0 WHERE id = 1 RETURNING *", None),
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


def adbc(served: Served, user: str) -> flight_sql.Connection:
    credentials = {"username": user, "password": PASSWORDS[user]}
    return flight_sql.connect(served.uri, db_kwargs=credentials, autocommit=True)


PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")


def add_user(served: Served, name: str, role: str) -> None:
    """A user made in the service's data directory as ``shardflow user add`` makes it (the
    command itself is tested above; a process per user would cost seconds)."""
    AuthStore(served.data_dir).add_user(name, role, f"{name}-pass")


def remove_user(served: Served, name: str) -> None:
    AuthStore(served.data_dir).remove_user(name)


def test_a_reader_granted_one_table_sees_and_reads_exactly_that_table(served: Served) -> None:
    """Grants per table: a table made through the service is its maker's; granted one
    table, a reader lists and reads that one through ADBC, pyarrow.flight and
    shardflow.connect, and a query naming the other is refused whole, naming it."""
    opened, closed = sample_table(300), sample_table(200)
    with as_user(served, "olga") as olga:
        olga.create_table("g_open", opened, distributed_by="id")
        olga.create_table("g_closed", closed, distributed_by="id")
        olga.sql("GRANT SELECT ON g_open TO alice")
    with as_user(served, "alice") as alice:
        names = set(alice.tables()["name"].to_pylist())
        assert "g_open" in names and "g_closed" not in names
        got = alice.sql("SELECT g, sum(x) AS x FROM g_open GROUP BY g ORDER BY g")
        expected = duckdb.sql("SELECT g, sum(x) AS x FROM opened GROUP BY g ORDER BY g")
        assert got.to_pylist() == expected.to_arrow_table().to_pylist()
        for query in (
            "SELECT count(*) FROM g_closed",
            "SELECT count(*) FROM g_open JOIN g_closed USING (id)",
            "SELECT * FROM g_open WHERE id IN (SELECT id FROM g_closed)",
            "WITH c AS (SELECT * FROM g_closed) SELECT count(*) FROM c",
        ):
            with pytest.raises(PermissionDeniedError, match="may not SELECT table g_closed"):
                alice.sql(query)
        with pytest.raises(shardflow.UnknownTableError) as unknown:
            alice.sql("SELECT * FROM nowhere")
        assert "g_closed" not in str(unknown.value)  # named only to whom may see it
    with adbc(served, "alice") as conn, conn.cursor() as cur:
        objects = conn.adbc_get_objects(depth="tables").read_all().to_pylist()
        listed = {t["table_name"] for c in objects for s in c["catalog_db_schemas"]
                  for t in s["db_schema_tables"]}  # fmt: skip
        assert "g_open" in listed and "g_closed" not in listed
        cur.execute("SELECT count(*) FROM g_open")
        assert cur.fetchall() == [(300,)]
        with pytest.raises(adbc_driver_manager.ProgrammingError, match="g_closed"):
            cur.execute("SELECT count(*) FROM g_closed")
    client, options = authenticated(served, "alice")
    command = fsql.pack(fsql.new("CommandGetTables", include_schema=False))
    info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
    listed = set(
        client.do_get(info.endpoints[0].ticket, options).read_all()["table_name"].to_pylist()
    )
    assert "g_open" in listed and "g_closed" not in listed
    with pytest.raises(flight.FlightUnauthorizedError, match="g_closed"):
        query = fsql.pack(fsql.new("CommandStatementQuery", query="SELECT * FROM g_closed"))
        client.get_flight_info(flight.FlightDescriptor.for_command(query), options)
    client.close()
    with as_user(served, "olga") as olga:
        olga.drop_table("g_open")
        olga.drop_table("g_closed")


def test_owners_grant_revocation_bites_and_a_new_user_of_an_old_name_inherits_nothing(
    served: Served,
) -> None:
    """A writer's table is theirs: they grant and revoke on it, others may not; a revoke
    ends a live session's reading within the service's one-second cache; SHOW GRANTS
    names other accounts only to the table's owner; a user removed and made again under
    the same name does not inherit the old one's grants; only the owner drops."""
    add_user(served, "carol", "reader")
    with as_user(served, "bob") as bob:
        bob.sql("CREATE TABLE mine AS SELECT id, s FROM t WHERE id < 100")
        bob.sql("GRANT SELECT ON mine TO carol")
        with as_user(served, "carol") as carol_db, as_user(served, "alice") as alice:
            assert carol_db.sql("SELECT count(*) AS n FROM mine")["n"][0].as_py() == 100
            with pytest.raises(PermissionDeniedError, match="may not SELECT table mine"):
                alice.sql("SELECT count(*) FROM mine")
            with pytest.raises(PermissionDeniedError, match="owner of mine or an operator"):
                carol_db.sql("GRANT SELECT ON mine TO alice")
            shown = carol_db.sql("SHOW GRANTS ON mine").to_pylist()
            assert shown == [{"table": "mine", "grantee": "carol", "privilege": "SELECT"}]
            owner_sees = {r["grantee"] for r in bob.sql("SHOW GRANTS ON mine").to_pylist()}
            assert owner_sees == {"bob", "carol"}
            bob.sql("REVOKE SELECT ON mine FROM carol")
            deadline = time.monotonic() + 10
            with pytest.raises(PermissionDeniedError):
                while time.monotonic() < deadline:  # at most a second's cache
                    carol_db.sql("SELECT count(*) AS n FROM mine")
                    time.sleep(0.1)
        bob.sql("GRANT SELECT ON mine TO carol")
        remove_user(served, "carol")
        add_user(served, "carol", "reader")
        with as_user(served, "carol") as new_carol:
            with pytest.raises(PermissionDeniedError, match="may not SELECT table mine"):
                new_carol.sql("SELECT count(*) FROM mine")
        with as_user(served, "olga") as olga:
            olga.sql("GRANT INSERT ON mine TO alice")  # an operator grants on any table
        with as_user(served, "alice") as alice:
            with pytest.raises(PermissionDeniedError, match="needs role writer"):
                alice.sql("INSERT INTO mine VALUES (1000, 'x')")  # the role still caps it
        bob.sql("DROP TABLE mine")
    remove_user(served, "carol")


def test_only_a_tables_owner_drops_or_replaces_it(served: Served) -> None:
    add_user(served, "walt", "writer")
    with as_user(served, "bob") as bob:
        bob.sql("CREATE TABLE bobs AS SELECT id FROM t WHERE id < 10")
        bob.grant("bobs", ["ALL"], "walt")  # the Python API over the service
        held = {(r["grantee"], r["privilege"]) for r in bob.grants("bobs").to_pylist()}
        assert held == {("bob", "OWNER"), *(("walt", p) for p in PRIVILEGES)}
    with as_user(served, "walt") as walt:
        walt.sql("INSERT INTO bobs VALUES (77)")  # granted INSERT: appends
        with pytest.raises(PermissionDeniedError, match="may not OWNER table bobs"):
            walt.drop_table("bobs")
        with pytest.raises(PermissionDeniedError, match="may not OWNER table bobs"):
            walt.sql("DROP TABLE bobs")
    with as_user(served, "bob") as bob:
        assert bob.sql("SELECT count(*) AS n FROM bobs")["n"][0].as_py() == 11
        bob.revoke("bobs", "INSERT", "walt")
        with as_user(served, "walt") as walt, pytest.raises(PermissionDeniedError):
            walt.sql("INSERT INTO bobs VALUES (78)")
        bob.sql("CREATE TABLE bobs_secret AS SELECT id FROM t WHERE id < 5")  # walt: no grant
        with as_user(served, "walt") as walt:  # reading it to choose rows is reading it
            for sneaky in (
                "WITH c AS (SELECT id FROM bobs_secret) DELETE FROM bobs WHERE id IN "
                "(SELECT id FROM c)",
                "DELETE FROM bobs WHERE id = 0 RETURNING (SELECT max(id) FROM bobs_secret)",
            ):
                with pytest.raises(PermissionDeniedError, match="may not SELECT table bobs_secr"):
                    walt.sql(sneaky)
        bob.drop_table("bobs_secret")
        with as_user(served, "walt") as walt:  # granted UPDATE and DELETE: changes rows
            assert walt.sql("UPDATE bobs SET id = id + 100 WHERE id < 3").to_pylist() == [
                {"count": 3}
            ]
            assert walt.sql("DELETE FROM bobs WHERE id = 77").to_pylist() == [{"count": 1}]
            assert walt.sql("TRUNCATE bobs").to_pylist() == [{"count": 10}]
        assert bob.sql("SELECT count(*) AS n FROM bobs")["n"][0].as_py() == 0
        bob.sql("INSERT INTO bobs VALUES (79)")
        bob.revoke("bobs", "DELETE", "walt")
        bob.revoke("bobs", "UPDATE", "walt")
        with as_user(served, "walt") as walt:
            with pytest.raises(PermissionDeniedError, match="may not DELETE table bobs"):
                walt.sql("TRUNCATE TABLE bobs")
            with pytest.raises(PermissionDeniedError, match="may not DELETE table bobs"):
                walt.sql("DELETE FROM bobs")
            with pytest.raises(PermissionDeniedError, match="may not UPDATE table bobs"):
                walt.sql("UPDATE bobs SET id = 0")
        assert bob.sql("SELECT count(*) AS n FROM bobs")["n"][0].as_py() == 1
        bob.drop_table("bobs")
    remove_user(served, "walt")


FILE_FUNCTIONS = (
    "read_text", "read_blob", "read_csv", "read_csv_auto", "read_json", "read_json_auto",
    "read_ndjson", "read_parquet", "parquet_scan", "parquet_metadata", "parquet_schema",
    "sniff_csv", "glob",
)  # fmt: skip
ESCAPES = [
    # files and the network through table functions
    *(f"SELECT * FROM {function}('{{users}}')" for function in FILE_FUNCTIONS),
    "SELECT * FROM read_parquet('http://127.0.0.1:9/x.parquet')",
    "SELECT * FROM read_csv('s3://bucket/x.csv')",
    "SELECT count(*) FROM t WHERE s IN (SELECT content FROM read_text('{users}'))",
    "SELECT * FROM \"read_text\"('{users}')",
    "SELECT * FROM READ_TEXT('{users}')",
    "SELECT * FROM read_text /* a comment */ ('{users}')",
    "SELECT * FROM query('SELECT * FROM read_text(''{users}'')')",
    "SELECT * FROM query_table('duckdb_settings')",
    # writing files, other databases, extensions, settings
    "COPY t TO '{scratch}/out.csv'",
    "COPY (SELECT 1) TO '{scratch}/out.parquet' (FORMAT parquet)",
    "EXPORT DATABASE '{scratch}/export'",
    "ATTACH '{scratch}/other.duckdb' AS other",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET temp_directory = '/'",
    "RESET enable_external_access",
    "PRAGMA database_list",
    "CALL pragma_version()",
    "CREATE SECRET s (TYPE s3, KEY_ID 'k', SECRET 'v')",
    "CREATE VIEW v AS SELECT * FROM t",
    "CREATE MACRO m(x) AS x + 1",
    # stacked statements and tricks around keywords
    "SELECT 1; DROP TABLE t",
    "SELECT 1 AS one; SELECT * FROM read_text('{users}')",
    "SELECT 1 --\n; DROP TABLE t",
    "SELECT * FROM ｒｅａｄ_text('{users}')",  # noqa: RUF001 (full-width letters)
    "SEL\u200bECT * FROM t",
    # size
    "SELECT " + "(" * 2000 + "1" + ")" * 2000,
    "SELECT " + " + ".join(["1"] * 20000),
    "SELECT '" + "x" * (2 << 20) + "'",
]
SERVER_STATE = [
    "SELECT * FROM duckdb_settings()",
    "SELECT * FROM duckdb_extensions()",
    "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM duckdb_temporary_files()",
    "SELECT getenv('HOME')",
    "SELECT current_setting('home_directory')",
    "SELECT * FROM pragma_database_size()",
    "SELECT * FROM duckdb_settings() WHERE name = 'temp_directory'",
    "SELECT * FROM (SELECT * FROM (SELECT version()))",
]


@pytest.mark.parametrize("user", ["alice", "bob", "olga"])
def test_hostile_statements_are_refused_for_every_role_and_the_service_serves_on(
    served: Served, user: str, tmp_path: Path
) -> None:
    """Escape attempts as a stranger would try them, as each role: files and the network
    through every table function that reads them, writing files, other databases,
    extensions and settings, stacked statements and tricks around keywords, very deep,
    long and big statements. Each is refused, leaves no file, names no server path and
    shows no stack nor any of the server's folders; the server's own state is an operator's
    only; the service serves on."""
    users = served.data_dir / "auth" / "users.json"
    answered = []
    with as_user(served, user) as db:
        for template in ESCAPES + (SERVER_STATE if user != "olga" else []):
            query = template.replace("{users}", str(users)).replace("{scratch}", str(tmp_path))
            try:
                db.sql(query)
            except shardflow.Error as error:
                message = str(error)
                assert "Traceback" not in message and 'File "' not in message, message
                # the server's folders are said by name, even where the query's own text
                # is quoted back: "<data directory>/auth/users.json"
                assert str(served.data_dir) not in message, message
                continue
            answered.append(template[:80])
        assert answered == [], f"answered for {user}: {answered}"
        assert list(tmp_path.iterdir()) == []
        assert db.sql("SELECT count(*) AS n FROM t")["n"][0].as_py() == 2000
