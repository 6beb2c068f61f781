"""Grants at the service's door: which tables a statement reads and writes, whether the
caller holds what each needs, and the ``GRANT``, ``REVOKE`` and ``SHOW GRANTS`` statements.

A table's grants live with it in the catalog (``Database.grants``); this reads them at most
``ttl_s`` old (one second: a revocation bites on the next call after that, in every replica
of the service) and checks every statement before anything runs: a statement naming one
table the caller may not reach is refused whole, naming that table. Operators reach every
table. A role caps what grants give: a reader granted INSERT still cannot write.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import sqlglot
from sqlglot import exp

from shardflow.errors import ConfigError, PermissionDeniedError, QueryError, UnknownTableError
from shardflow.service.auth import ROLES, AuthStore, Principal, role_allows

if TYPE_CHECKING:
    from shardflow.api import Database

OWNER = "OWNER"
PUBLIC = "PUBLIC"
SEES = ("SELECT", "INSERT", "UPDATE", "DELETE", OWNER)
"""Any one of these lets an account see that a table exists (listings, errors)."""
TTL_S = 1.0
Grants = tuple[tuple[str, str, str], ...]
_SHOW = re.compile(
    r"^\s*show\s+grants(?:\s+on(?:\s+table)?\s+(?P<table>\"[^\"]+\"|[^\s;]+))?\s*;?\s*$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Needs:
    """What a statement needs: the tables it reads (SELECT) and the one it writes."""

    reads: tuple[str, ...]
    writes: str | None = None
    write_privilege: str = "INSERT"


def allows(principal: Principal, grants: Grants, privilege: str) -> bool:
    """Whether ``principal`` holds ``privilege`` by ``grants`` (OWNER holds every one)."""
    if principal.role == "operator":
        return True
    for grantee, held, account in grants:
        if held != privilege and held != OWNER:
            continue
        if grantee == PUBLIC or (grantee in ROLES and role_allows(principal.role, grantee)):
            return True
        if grantee == principal.name and account == principal.account_id:
            return True
    return False


def key(name: str) -> str:
    """A table name as DuckDB compares them: ASCII letters case-insensitively."""
    return "".join(c.lower() if c.isascii() else c for c in name)


class Access:
    """The grants the service checks calls against, each read at most ``ttl_s`` ago."""

    def __init__(
        self,
        db: Database,
        store: AuthStore,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._all: tuple[float, dict[str, tuple[str, Grants]]] | None = None

    # -- reading ------------------------------------------------------------------------
    def tables(self) -> dict[str, tuple[str, Grants]]:
        """Every table by :func:`key`: its name and grants."""
        with self._lock:
            held = self._all
        if held is not None and self.clock() - held[0] < self.ttl_s:
            return held[1]
        found: dict[str, tuple[str, list[tuple[str, str, str]]]] = {}
        listing = self.db.grants().to_pylist()
        for row in listing:
            grants = found.setdefault(key(row["table"]), (row["table"], []))[1]
            if row["grantee"] is not None:
                grants.append((row["grantee"], row["privilege"], row["grantee_id"] or ""))
        tables = {k: (name, tuple(grants)) for k, (name, grants) in found.items()}
        with self._lock:
            self._all = (self.clock(), tables)
        return tables

    def forget(self) -> None:
        """Read the grants afresh at the next call (they were changed here)."""
        with self._lock:
            self._all = None

    def visible(self, principal: Principal) -> list[str]:
        """The tables ``principal`` may see, by name."""
        return sorted(
            name
            for name, grants in self.tables().values()
            if any(allows(principal, grants, p) for p in SEES)
        )

    # -- checking -----------------------------------------------------------------------
    def check(self, principal: Principal, needs: Needs) -> None:
        """Refuse (``PermissionDeniedError``, naming the table) a statement whose tables
        ``principal`` may not reach; an unknown table is an ``UnknownTableError`` naming
        only the tables the caller may see. Nothing has run yet either way."""
        tables = self.tables()
        wanted = [(name, "SELECT") for name in needs.reads]
        if needs.writes is not None:
            wanted.append((needs.writes, needs.write_privilege))
        for name, privilege in wanted:
            found = tables.get(key(name))
            if found is None:
                raise self._unknown(principal, name)
            spelled, grants = found
            if not allows(principal, grants, privilege):
                raise PermissionDeniedError(
                    f"permission denied: {principal.name} may not {privilege} table "
                    f"{spelled} (its owner or an operator grants it: GRANT {privilege} ON "
                    f"{spelled} TO {principal.name})"
                )

    def _unknown(self, principal: Principal, name: str) -> UnknownTableError:
        """No table ``name`` that ``principal`` may see: the error names those it may."""
        seen = ", ".join(self.visible(principal)) or "none you may read"
        return UnknownTableError(f"unknown table {name!r} (tables: {seen})")

    # -- GRANT, REVOKE, SHOW GRANTS -------------------------------------------------------
    def statement(self, principal: Principal, tree: exp.Expr) -> pa.Table:
        """Run ``GRANT``/``REVOKE`` as ``principal`` (the table's owner or an operator)."""
        assert isinstance(tree, exp.Grant | exp.Revoke)
        securable = tree.args.get("securable")
        if not isinstance(securable, exp.Table) or not securable.name:
            raise QueryError("GRANT and REVOKE name one table: GRANT SELECT ON t TO alice")
        found = self.tables().get(key(securable.name))
        if found is None or not any(allows(principal, found[1], p) for p in SEES):
            raise self._unknown(principal, securable.name)
        name, grants = found
        if not allows(principal, grants, OWNER):
            raise PermissionDeniedError(
                f"permission denied: only the owner of {name} or an operator grants on it"
            )
        if tree.args.get("grant_option"):
            raise QueryError("shardflow has no WITH GRANT OPTION: owners and operators grant")
        words = [
            p.this.name if isinstance(p.this, exp.Var) else p.sql() for p in tree.args["privileges"]
        ]
        for principal_node in tree.args.get("principals") or []:
            grantee, account = self._grantee(principal_node.this.name)
            try:
                if isinstance(tree, exp.Grant):
                    self.db.grant(name, words, grantee, grantee_id=account)
                else:
                    self.db.revoke(name, words, grantee)
            except ConfigError as error:
                raise QueryError(str(error)) from None
        self.forget()
        return pa.table({})

    def show(self, principal: Principal, query: str) -> pa.Table | None:
        """``SHOW GRANTS [ON [TABLE] t]`` (None: ``query`` is not one). An operator sees
        every grant; others see those of the tables they own, and on other tables they may
        see the grants to PUBLIC, to roles and to themselves: not other accounts' names."""
        found = _SHOW.match(query)
        if found is None:
            return None
        wanted = found["table"]
        rows = []
        for name, grants in sorted(self.tables().values()):
            if wanted is not None and key(name) != key(wanted.strip('"')):
                continue
            if not any(allows(principal, grants, p) for p in SEES):
                continue
            owner = allows(principal, grants, OWNER)
            for grantee, privilege, _ in grants:
                mine = grantee in (PUBLIC, *ROLES) or grantee == principal.name
                if owner or mine:
                    rows.append({"table": name, "grantee": grantee, "privilege": privilege})
        schema = pa.schema([(n, pa.string()) for n in ("table", "grantee", "privilege")])
        return pa.Table.from_pylist(rows, schema=schema)

    def _grantee(self, name: str) -> tuple[str, str]:
        """A grantee as a grant names it, and its account id: PUBLIC, a role, or an
        account (a role's name wins over an account's)."""
        if name.upper() == PUBLIC:
            return PUBLIC, ""
        if name.lower() in ROLES:
            return name.lower(), ""
        account = self.store.account(name)
        if account is None:
            raise ConfigError(
                f"no user, service account or role named {name!r}: grant to an account "
                f"(`shardflow user list`), a role ({', '.join(ROLES)}) or PUBLIC"
            )
        return account.name, account.account_id


def needs_of(tree: exp.Expr) -> Needs:
    """The tables a parsed statement reads, and the one it writes (INSERT's target, with
    INSERT; TRUNCATE's and DELETE's, with DELETE; UPDATE's, with UPDATE; a table a CREATE
    makes is new, a DROP needs OWNER: the caller checks those)."""
    ctes = {key(cte.alias_or_name) for cte in tree.find_all(exp.CTE)}
    target: str | None = None
    if isinstance(tree, exp.TruncateTable):
        emptied = [t.name for t in tree.expressions if isinstance(t, exp.Table)]
        return Needs((), emptied[0] if emptied else None, "DELETE")
    if isinstance(tree, exp.Delete | exp.Update):
        changed = tree.this.name if isinstance(tree.this, exp.Table) else None
        verb = "DELETE" if isinstance(tree, exp.Delete) else "UPDATE"
        reads = [
            name
            for part in ("with_", "where", "using", "from_", "expressions", "returning")
            for value in _as_list(tree.args.get(part))
            for name in _table_names(value, ctes)
        ]
        values = [a.expression for a in tree.expressions if isinstance(a, exp.EQ)]
        if changed and (tree.args.get("where") or any(v.find(exp.Column) for v in values)):
            reads.insert(0, changed)  # it reads the rows it chooses (as PostgreSQL asks)
        return Needs(tuple(dict.fromkeys(reads)), changed, verb)
    if isinstance(tree, exp.Insert):
        into = tree.this
        target = (into.this if isinstance(into, exp.Schema) else into).name
        tree = tree.expression
    elif isinstance(tree, exp.Create):
        tree = tree.expression
    reads = [] if tree is None else list(_table_names(tree, ctes))
    return Needs(tuple(dict.fromkeys(reads)), target)


def _as_list(value: object) -> list[exp.Expr]:
    """A statement's part as a list of expressions (none, one, or several)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, exp.Expr)]


def needs_of_text(query: str, tables: Iterable[str]) -> Needs:
    """What an unparsable statement may read: every table named anywhere in it (a word
    of its equal to a table's name), so that nothing ungranted slips past the parser."""
    known = {key(name): name for name in tables}
    words = re.findall(r'"([^"]+)"|([^\W\d][\w$]*)', query)
    named = [known[key(q or w)] for q, w in words if key(q or w) in known]
    return Needs(tuple(dict.fromkeys(named)))


def _table_names(tree: exp.Expr, ctes: set[str]) -> Iterable[str]:
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):
            continue  # a table function: its own checks apply
        if table.args.get("db") or table.args.get("catalog"):
            continue  # not a shardflow table: the query's own error says so
        if key(table.name) not in ctes:
            yield table.name


def parse(query: str) -> exp.Expr | None:
    """``query`` parsed, or None where SQLGlot cannot (:func:`needs_of_text` then)."""
    try:
        return sqlglot.parse_one(query, read="duckdb")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return None
