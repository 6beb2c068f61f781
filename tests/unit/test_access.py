"""The service's grant checks as plain data (``service/access.py``): who a grant reaches,
which tables a statement reads and writes, and how old a grant read may be."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
import sqlglot

from shardflow.api import GRANTS_SCHEMA
from shardflow.errors import PermissionDeniedError, UnknownTableError
from shardflow.service.access import Access, Needs, allows, needs_of, needs_of_text
from shardflow.service.auth import Principal

ALICE = Principal("alice", "reader", "user", "2026-01-01T00:00:00.000001+00:00")
BOB = Principal("bob", "writer", "user", "2026-01-02T00:00:00.000001+00:00")
OLGA = Principal("olga", "operator", "user", "2026-01-03T00:00:00.000001+00:00")


def test_a_grant_reaches_its_account_of_that_making_roles_upwards_and_public() -> None:
    to_alice = (("alice", "SELECT", ALICE.account_id),)
    assert allows(ALICE, to_alice, "SELECT") and not allows(ALICE, to_alice, "INSERT")
    assert not allows(BOB, to_alice, "SELECT")
    reborn = Principal("alice", "reader", "user", "2026-06-01T00:00:00.000001+00:00")
    assert not allows(reborn, to_alice, "SELECT")  # same name, another account
    to_readers = (("reader", "SELECT", ""),)
    assert allows(ALICE, to_readers, "SELECT") and allows(BOB, to_readers, "SELECT")
    assert not allows(ALICE, (("writer", "SELECT", ""),), "SELECT")
    assert allows(BOB, (("PUBLIC", "INSERT", ""),), "INSERT")
    owned = (("bob", "OWNER", BOB.account_id),)
    assert all(allows(BOB, owned, p) for p in ("SELECT", "INSERT", "DELETE", "OWNER"))
    assert not allows(ALICE, owned, "SELECT") and allows(OLGA, (), "OWNER")


@pytest.mark.parametrize(
    ("query", "reads", "writes"),
    [
        ("SELECT * FROM a JOIN b USING (k)", ("a", "b"), None),
        ("SELECT * FROM a WHERE k IN (SELECT k FROM b)", ("a", "b"), None),
        ("WITH c AS (SELECT * FROM a) SELECT * FROM c, range(3)", ("a",), None),
        ("INSERT INTO t SELECT * FROM a", ("a",), "t"),
        ("INSERT INTO t (x) VALUES (1)", (), "t"),
        ("CREATE TABLE n AS SELECT * FROM a UNION ALL SELECT * FROM b", ("a", "b"), None),
        ("SELECT * FROM information_schema.tables", (), None),
    ],
)
def test_a_statement_needs_the_tables_it_reads_and_writes(
    query: str, reads: tuple[str, ...], writes: str | None
) -> None:
    needs = needs_of(sqlglot.parse_one(query, read="duckdb"))
    assert (set(needs.reads), needs.writes) == (set(reads), writes)


def test_a_statement_the_parser_cannot_read_needs_every_table_it_names() -> None:
    needs = needs_of_text('SELECT * FROM "Secret" s, open o WHERE ???', ["secret", "open", "x"])
    assert set(needs.reads) == {"secret", "open"}


class Grants:
    """The public ``Database.grants`` as plain data, counting its reads."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.reads = 0

    def grants(self) -> pa.Table:
        self.reads += 1
        return pa.Table.from_pylist(self.rows, schema=GRANTS_SCHEMA)


def test_grants_are_read_at_most_a_second_old_and_checked_whole() -> None:
    now = [0.0]
    db = Grants(
        [
            {"table": "open", "grantee": "alice", "privilege": "SELECT",
             "grantee_id": ALICE.account_id},
            {"table": "shut", "grantee": None, "privilege": None, "grantee_id": None},
        ]
    )  # fmt: skip
    access = Access(db, store=None, ttl_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    access.check(ALICE, Needs(("open",)))
    with pytest.raises(PermissionDeniedError, match="may not SELECT table shut"):
        access.check(ALICE, Needs(("open", "shut")))
    with pytest.raises(UnknownTableError) as unknown:
        access.check(ALICE, Needs(("gone",)))
    assert "shut" not in str(unknown.value) and "open" in str(unknown.value)
    assert access.visible(ALICE) == ["open"] and access.visible(OLGA) == ["open", "shut"]
    db.rows[0] = {**db.rows[0], "grantee": "bob"}  # revoked elsewhere (another replica)
    now[0] = 0.9
    access.check(ALICE, Needs(("open",)))  # within the second: as read
    assert db.reads == 1
    now[0] = 1.1
    with pytest.raises(PermissionDeniedError):
        access.check(ALICE, Needs(("open",)))
    assert db.reads == 2
