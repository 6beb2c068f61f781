"""Accounts, roles, bearer tokens and the audit log of the network service (plain files)."""

from __future__ import annotations

import doctest
import hashlib
import json
import os
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from argon2 import PasswordHasher

from shardflow.audit import AuditLog
from shardflow.errors import ConfigError
from shardflow.service import auth
from shardflow.service.auth import (
    ROLES,
    AuthStore,
    Principal,
    TokenIssuer,
    check_role,
    parse_since,
    role_allows,
)

# Cheap argon2 parameters: each hash takes a millisecond instead of a tenth of a second.
FAST = PasswordHasher(time_cost=1, memory_cost=64, parallelism=1)


class FakeClock:
    def __init__(self, now: float = 1_750_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def store(data_dir: Path, clock: FakeClock | None = None) -> AuthStore:
    return AuthStore(data_dir, hasher=FAST, clock=clock or FakeClock())


def test_docstring_examples_run() -> None:
    assert doctest.testmod(auth).failed == 0


def test_roles_each_include_the_ones_before() -> None:
    allowed = {(r, n) for r in ROLES for n in ROLES if role_allows(r, n)}
    assert allowed == {
        ("reader", "reader"),
        ("writer", "reader"),
        ("writer", "writer"),
        ("operator", "reader"),
        ("operator", "writer"),
        ("operator", "operator"),
    }
    assert not role_allows("admin", "reader")  # unknown roles allow nothing
    assert check_role("writer") == "writer"
    with pytest.raises(ConfigError, match="reader, writer, operator"):
        check_role("admin")
    with pytest.raises(ConfigError):
        role_allows("writer", "root")


def test_users_add_verify_remove(tmp_path: Path) -> None:
    accounts = store(tmp_path)
    accounts.add_user("ada", "writer", "correct horse")
    assert accounts.verify_password("ada", "correct horse") == Principal("ada", "writer", "user")
    assert accounts.verify_password("ada", "wrong") is None
    assert accounts.verify_password("ada", "") is None
    assert accounts.verify_password("nobody", "correct horse") is None
    assert accounts.users() == [
        {"name": "ada", "role": "writer", "created": "2025-06-15T15:06:40+00:00"}
    ]
    accounts.remove_user("ada")
    assert accounts.users() == []
    assert accounts.verify_password("ada", "correct horse") is None
    with pytest.raises(ConfigError, match="no user 'ada'"):
        accounts.remove_user("ada")


def test_only_an_argon2_hash_is_stored_in_private_files(tmp_path: Path) -> None:
    accounts = store(tmp_path)
    accounts.add_user("ada", "reader", "s3cret-Passw0rd")
    users_file = tmp_path / "auth" / "users.json"
    text = users_file.read_text()
    assert "s3cret-Passw0rd" not in text
    assert json.loads(text)["ada"]["hash"].startswith("$argon2id$")
    assert "hash" not in accounts.users()[0]
    assert stat.S_IMODE(os.stat(tmp_path / "auth").st_mode) == 0o700
    for name in ("users.json", ".lock"):
        assert stat.S_IMODE(os.stat(tmp_path / "auth" / name).st_mode) == 0o600
    assert [p.name for p in (tmp_path / "auth").iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    ("name", "role", "password", "message"),
    [
        ("ada", "reader", "another", "exists"),
        ("bob", "admin", "pw", "unknown role"),
        ("bob smith", "reader", "pw", "invalid user name"),
        ("", "reader", "pw", "invalid user name"),
        ("b" * 65, "reader", "pw", "invalid user name"),
        ("bob", "reader", "", "empty"),
    ],
)
def test_a_refused_user_writes_nothing(
    tmp_path: Path, name: str, role: str, password: str, message: str
) -> None:
    accounts = store(tmp_path)
    accounts.add_user("ada", "reader", "first")
    users_file = tmp_path / "auth" / "users.json"
    before = users_file.read_bytes()
    with pytest.raises(ConfigError, match=message):
        accounts.add_user(name, role, password)
    assert users_file.read_bytes() == before
    assert accounts.verify_password("ada", "first") is not None


def test_names_may_use_letters_digits_and_some_punctuation(tmp_path: Path) -> None:
    accounts = store(tmp_path)
    for name in ("a", "ada.lovelace@example.com", "svc_etl-2", "x" * 64):
        accounts.add_user(name, "reader", "pw")
    assert len(accounts.users()) == 4


def test_another_instance_sees_changes_without_a_restart(tmp_path: Path) -> None:
    server, cli = store(tmp_path), store(tmp_path)
    assert server.verify_password("ada", "pw") is None  # caches an empty store
    cli.add_user("ada", "operator", "pw")
    assert server.verify_password("ada", "pw") == Principal("ada", "operator", "user")
    cli.remove_user("ada")
    cli.add_user("ada", "reader", "pw")  # same name and file size: a new file all the same
    assert server.verify_password("ada", "pw") == Principal("ada", "reader", "user")
    _, token = cli.create_service_token("writer", name="etl")
    assert server.principal_for_token(token) == Principal("etl", "writer", "service")
    cli.revoke_token("etl")
    assert server.principal_for_token(token) is None


def test_a_weaker_hash_is_upgraded_at_login(tmp_path: Path) -> None:
    store(tmp_path).add_user("ada", "reader", "pw")
    stronger = PasswordHasher(time_cost=2, memory_cost=128, parallelism=1)
    accounts = AuthStore(tmp_path, hasher=stronger)
    assert accounts.verify_password("ada", "pw") is not None
    stored = json.loads((tmp_path / "auth" / "users.json").read_text())["ada"]["hash"]
    assert not stronger.check_needs_rehash(stored)
    assert accounts.verify_password("ada", "pw") is not None
    assert accounts.verify_password("ada", "wrong") is None


def test_service_tokens_store_only_a_digest(tmp_path: Path) -> None:
    accounts = store(tmp_path)
    name, token = accounts.create_service_token("writer")
    assert name.startswith("svc-") and len(name) == len("svc-") + 8
    assert token.startswith("sft_") and len(token) > 40
    text = (tmp_path / "auth" / "tokens.json").read_text()
    assert token not in text and token.removeprefix("sft_") not in text
    assert hashlib.sha256(token.encode()).hexdigest() in text
    assert stat.S_IMODE(os.stat(tmp_path / "auth" / "tokens.json").st_mode) == 0o600
    assert accounts.principal_for_token(token) == Principal(name, "writer", "service")
    assert accounts.principal_for_token(token + "x") is None
    assert accounts.principal_for_token("sft_unknown") is None
    assert accounts.principal_for_token(hashlib.sha256(token.encode()).hexdigest()) is None
    [listed] = accounts.service_tokens()
    assert listed == {
        "name": name,
        "role": "writer",
        "created": "2025-06-15T15:06:40+00:00",
        "expires": None,
        "expired": False,
    }


def test_service_tokens_expire_and_are_revoked(tmp_path: Path) -> None:
    clock = FakeClock()
    accounts = store(tmp_path, clock)
    _, short = accounts.create_service_token("reader", name="short", ttl_s=60)
    _, forever = accounts.create_service_token("operator", name="forever")
    clock.now += 59.5
    assert accounts.principal_for_token(short) is not None
    clock.now += 1
    assert accounts.principal_for_token(short) is None
    assert {t["name"]: t["expired"] for t in accounts.service_tokens()} == {
        "short": True,
        "forever": False,
    }
    assert accounts.principal_for_token(forever) == Principal("forever", "operator", "service")
    accounts.revoke_token("forever")
    assert accounts.principal_for_token(forever) is None
    assert [t["name"] for t in accounts.service_tokens()] == ["short"]
    with pytest.raises(ConfigError, match="no service token 'forever'"):
        accounts.revoke_token("forever")


def test_refused_service_tokens(tmp_path: Path) -> None:
    accounts = store(tmp_path)
    accounts.create_service_token("reader", name="etl")
    with pytest.raises(ConfigError, match="exists"):
        accounts.create_service_token("reader", name="etl")
    with pytest.raises(ConfigError, match="unknown role"):
        accounts.create_service_token("root")
    with pytest.raises(ConfigError, match="positive"):
        accounts.create_service_token("reader", ttl_s=0)
    with pytest.raises(ConfigError, match="invalid service token name"):
        accounts.create_service_token("reader", name="a/b")
    assert len(accounts.service_tokens()) == 1


def test_a_damaged_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "users.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"users\.json is damaged"):
        store(tmp_path).verify_password("ada", "pw")


def test_a_remote_data_directory_is_refused() -> None:
    with pytest.raises(ConfigError, match="local data directory"):
        AuthStore("s3://bucket/data")


def test_concurrent_writers_lose_no_user(tmp_path: Path) -> None:
    def add(index: int) -> None:
        store(tmp_path).add_user(f"user{index}", "reader", "pw")  # each its own instance

    threads = [threading.Thread(target=add, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store(tmp_path).users()) == 16


def test_bearer_tokens_expire() -> None:
    clock = FakeClock(100.0)
    issuer = TokenIssuer(ttl_s=10.0, clock=clock)
    ada = Principal("ada", "reader", "user")
    token = issuer.issue(ada)
    assert issuer.resolve(token) == ada
    assert issuer.resolve("guess") is None
    clock.now += 9.9
    assert issuer.resolve(token) == ada
    clock.now += 0.1
    assert issuer.resolve(token) is None
    assert len(issuer) == 0  # dropped once seen expired


def test_bearer_tokens_are_bounded() -> None:
    clock = FakeClock(0.0)
    issuer = TokenIssuer(ttl_s=10.0, clock=clock, max_live=3)
    ada = Principal("ada", "reader", "user")
    old = [issuer.issue(ada) for _ in range(3)]
    clock.now = 5.0
    newer = [issuer.issue(ada) for _ in range(2)]  # the cap drops the two oldest
    assert [issuer.resolve(t) for t in old] == [None, None, ada]
    clock.now = 12.0
    issuer.issue(ada)  # drops the expired one
    assert len(issuer) == 3
    assert all(issuer.resolve(t) == ada for t in newer)
    with pytest.raises(ConfigError):
        TokenIssuer(ttl_s=0)


def test_signed_bearer_tokens_are_taken_by_every_holder_of_the_key(tmp_path: Path) -> None:
    """Two replicas of the service (two stores over one data directory): a token one of them
    issued is taken by the other; a changed token, another key or a late one is not."""
    key = store(tmp_path).signing_key()
    assert store(tmp_path).signing_key() == key  # made once, read after
    assert stat.S_IMODE(os.stat(tmp_path / "auth" / "signing.key").st_mode) == 0o600
    clock = FakeClock(1000.0)
    one = TokenIssuer(ttl_s=10.0, clock=clock, key=key)
    other = TokenIssuer(ttl_s=10.0, clock=clock, key=store(tmp_path).signing_key())
    ada = Principal("ada", "writer", "user")
    token = one.issue(ada)
    assert other.resolve(token) == ada and len(other) == 1  # verified once, then kept
    assert other.resolve(token) == ada
    body, mac = token.rsplit(".", 1)
    forged = body.replace(body[-4:], "AAAA") + "." + mac
    assert other.resolve(forged) is None
    assert other.resolve(token[:-2]) is None and other.resolve("sfb1.x.y") is None
    assert len(other) == 1  # what failed its check is not kept
    assert TokenIssuer(ttl_s=10.0, clock=clock, key=b"another key").resolve(token) is None
    assert TokenIssuer(ttl_s=10.0, clock=clock).resolve(token) is None  # unsigned issuer
    clock.now += 10.0
    assert other.resolve(token) is None and len(other) == 0  # expired, kept or not


def test_audit_log_records_and_filters(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    assert log.entries() == []
    start = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    log.record("ada", "query", {"sql": "SELECT 1"}, "ok", 0.0125, when=start)
    log.record(
        "etl",
        "insert",
        {"table": "t", "path": Path("/x.parquet"), "rows": (1, 2)},
        "denied: needs writer",
        0.001,
        when=start + timedelta(hours=1),
    )
    entries = log.entries()
    assert entries[0] == {
        "time": "2025-01-01T12:00:00.000+00:00",
        "who": "ada",
        "action": "query",
        "arguments": {"sql": "SELECT 1"},
        "outcome": "ok",
        "duration_s": 0.0125,
    }
    assert entries[1]["arguments"] == {"table": "t", "path": "/x.parquet", "rows": [1, 2]}
    assert [e["who"] for e in log.entries(since=start + timedelta(minutes=30))] == ["etl"]
    assert log.entries(since=start + timedelta(hours=2)) == []
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600


def test_audit_log_skips_a_torn_last_line(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    log.record("ada", "query", {}, "ok", 0.1)
    with log.path.open("ab") as out:
        out.write(b'{"time": "2025-01-01T12:00:00+00:00", "who": "bo')
    assert [e["who"] for e in log.entries()] == ["ada"]


def test_concurrent_audit_writers_write_whole_lines(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    sql = "SELECT " + "x" * 5000  # longer than any buffer that could split a line

    def write(who: str) -> None:
        for i in range(50):
            log.record(who, "query", {"sql": sql, "i": i}, "ok", 0.0)

    threads = [threading.Thread(target=write, args=(f"user{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = log.path.read_text().splitlines()
    assert len(lines) == 400
    entries = [json.loads(line) for line in lines]
    assert all(e["arguments"]["sql"] == sql for e in entries)
    for n in range(8):
        assert [e["arguments"]["i"] for e in entries if e["who"] == f"user{n}"] == list(range(50))


def test_parse_since() -> None:
    now = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    assert parse_since("30s", now) == now - timedelta(seconds=30)
    assert parse_since("10m", now) == now - timedelta(minutes=10)
    assert parse_since("2h", now) == now - timedelta(hours=2)
    assert parse_since("1d", now) == now - timedelta(days=1)
    assert parse_since("2025-01-01T10:00:00+00:00") == datetime(2025, 1, 1, 10, tzinfo=UTC)
    assert parse_since("2025-01-01T10:00:00Z") == datetime(2025, 1, 1, 10, tzinfo=UTC)
    naive = parse_since("2025-01-01T10:00")
    assert naive.tzinfo is not None  # read as local time
    for bad in ("yesterday", "10 minutes", "-5m", ""):
        with pytest.raises(ConfigError, match="since takes"):
            parse_since(bad)


def test_a_token_made_elsewhere_replaces_the_older_one_of_its_name(tmp_path: Path) -> None:
    """``shardflow serve --operator-token-file``: the Kubernetes Secret's token is accepted
    as the operator's; a new Secret value makes the old token invalid."""
    accounts = store(tmp_path)
    first, second = "sft_" + "a" * 40, "sft_" + "b" * 40
    accounts.put_service_token("k8s-operator", "operator", first)
    assert accounts.principal_for_token(first) == Principal("k8s-operator", "operator", "service")
    accounts.put_service_token("k8s-operator", "operator", second)
    assert accounts.principal_for_token(first) is None
    assert accounts.principal_for_token(second) is not None
    assert [t["name"] for t in accounts.service_tokens()] == ["k8s-operator"]
    for bad in ("a" * 50, "sft_short"):
        with pytest.raises(ConfigError, match="starts with"):
            accounts.put_service_token("k8s-operator", "operator", bad)
    assert accounts.principal_for_token(second) is not None  # a refused one changes nothing
