"""``shardflow user``, ``token`` and ``audit``, run as users run them (a real process each).

They read and write files under the data directory only: no Ray starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from shardflow.audit import AuditLog
from shardflow.service.auth import AuthStore

SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDFLOW, *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_users_added_listed_and_removed(tmp_path: Path) -> None:
    where = ("--data-dir", str(tmp_path))
    added = run("user", "add", "ada", "--role", "writer", "--password-stdin", *where, stdin="pw\n")
    assert added.returncode == 0, added.stdout + added.stderr
    assert "added user ada (writer)" in added.stdout
    accounts = AuthStore(tmp_path)
    assert accounts.verify_password("ada", "pw") is not None  # the newline is not part of it
    assert accounts.verify_password("ada", "pw\n") is None

    listed = run("user", "list", *where)
    assert listed.returncode == 0
    rows = [line.split("│")[1:3] for line in listed.stdout.splitlines() if "│" in line]
    assert rows == [[" ada  ", " writer "]]

    again = run("user", "add", "ada", "--role", "reader", "--password-stdin", *where, stdin="x")
    assert again.returncode == 2 and "user 'ada' exists" in again.stdout

    removed = run("user", "remove", "ada", *where)
    assert removed.returncode == 0 and "removed user ada" in removed.stdout
    assert AuthStore(tmp_path).users() == []
    gone = run("user", "remove", "ada", *where)
    assert gone.returncode == 2 and "no user 'ada'" in gone.stdout


def test_bad_role_and_empty_password_exit_2(tmp_path: Path) -> None:
    where = ("--data-dir", str(tmp_path))
    bad = run("user", "add", "ada", "--role", "admin", "--password-stdin", *where, stdin="pw")
    assert bad.returncode == 2
    assert "ConfigError: unknown role 'admin'; a role is one of: reader, writer, operator" in (
        bad.stdout
    )
    empty = run("user", "add", "ada", "--role", "reader", "--password-stdin", *where, stdin="\n")
    assert empty.returncode == 2 and "empty" in empty.stdout
    token = run("token", "create", "--role", "root", *where)
    assert token.returncode == 2 and "unknown role 'root'" in token.stdout
    assert not (tmp_path / "auth" / "users.json").exists()


def test_service_tokens_created_listed_revoked(tmp_path: Path) -> None:
    where = ("--data-dir", str(tmp_path))
    created = run("token", "create", "--role", "reader", "--name", "etl", "--ttl", "3600", *where)
    assert created.returncode == 0, created.stdout + created.stderr
    token = created.stdout.splitlines()[-1]
    assert token.startswith("sft_") and token == token.strip()
    assert "shown only once" in created.stdout
    assert AuthStore(tmp_path).principal_for_token(token) is not None

    listed = run("token", "list", *where)
    assert listed.returncode == 0 and "etl" in listed.stdout and "reader" in listed.stdout
    assert token not in listed.stdout

    revoked = run("token", "revoke", "etl", *where)
    assert revoked.returncode == 0 and "revoked service token etl" in revoked.stdout
    assert AuthStore(tmp_path).principal_for_token(token) is None
    assert run("token", "revoke", "etl", *where).returncode == 2


def test_audit_empty_then_filled(tmp_path: Path) -> None:
    where = ("--data-dir", str(tmp_path))
    empty = run("audit", *where)
    assert empty.returncode == 0 and "no audit entries" in empty.stdout
    assert run("audit", "--json", *where).stdout == ""

    log = AuditLog(tmp_path)
    log.record("ada", "query", {"sql": "SELECT [1]"}, "ok", 0.0125)
    log.record("bob", "cluster.drain", {"node": "node-1"}, "denied: needs operator", 0.0004)
    log.record("old", "query", {}, "error: boom", 1.0, when=datetime.now(UTC) - timedelta(hours=3))

    shown = run("audit", *where)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for text in ("ada", "SELECT [1]", "12.5", "denied: needs operator", "cluster.drain", "old"):
        assert text in shown.stdout

    lines = run("audit", "--json", "--since", "1h", *where).stdout.splitlines()
    assert [json.loads(line)["who"] for line in lines] == ["ada", "bob"]

    checked = run("audit", "verify", *where)
    assert checked.returncode == 0 and "3 entries in 1 file(s), the chain intact" in checked.stdout
    kept = log.path.read_text().splitlines()
    log.path.write_text("\n".join([kept[0], kept[2]]) + "\n")  # bob's line taken out
    broken = run("audit", "verify", *where)
    assert broken.returncode == 2 and "chain breaks at audit.jsonl:2" in broken.stdout

    bad = run("audit", "--since", "yesterday", *where)
    assert bad.returncode == 2 and "since takes" in bad.stdout
