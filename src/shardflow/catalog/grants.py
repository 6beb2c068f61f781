"""Who may do what with a table: its owner and its grants, kept with the table in the
catalog (as CockroachDB keeps privileges in a table's descriptor), so they are made,
changed and dropped with it, logged and recovered as every catalog change is.

A grant is ``(grantee, privilege, account)``. The privileges are SELECT, INSERT, UPDATE and
DELETE, and OWNER: all of them, and the right to grant them and to drop the table; the
service gives it to the account that makes a table. The grantee is a user or service
account of the Flight SQL service, a role (``reader``, ``writer``, ``operator``: it reaches
every account of that role or a higher one), or ``PUBLIC`` (every account). ``account`` is
the id of the account it was given to: a user removed and added again under the same name
is a new account and does not inherit the old one's grants ("" for roles and PUBLIC). The
service enforces them (``service/access.py``); the Python API in the cluster's own process
is the owner's door and is not checked.

A table made through the Python API (or before grants existed) is shared: PUBLIC holds
every privilege, so every account reaches it within its role, as before; ``REVOKE ... FROM
PUBLIC`` closes it. A table made through the service is its creator's: OWNER to them and
nothing else, so only they and operators reach it until someone grants it.
"""

from __future__ import annotations

from collections.abc import Iterable

PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")
OWNER = "OWNER"
PUBLIC = "PUBLIC"
Grant = tuple[str, str, str]
"""(grantee, privilege, account id)."""

SHARED: tuple[Grant, ...] = tuple((PUBLIC, privilege, "") for privilege in PRIVILEGES)
"""The grants of a table made outside the service: every privilege to every account."""


def privileges_of(words: Iterable[str]) -> tuple[str, ...]:
    """Privilege names as a statement spells them (``ALL [PRIVILEGES]`` is every one), in
    ``PRIVILEGES`` order; ``ValueError`` naming an unknown one."""
    wanted: set[str] = set()
    for word in words:
        upper = " ".join(word.upper().split())
        if upper in ("ALL", "ALL PRIVILEGES"):
            wanted.update(PRIVILEGES)
        elif upper in PRIVILEGES:
            wanted.add(upper)
        else:
            raise ValueError(f"unknown privilege {word!r}: use {', '.join(PRIVILEGES)} or ALL")
    return tuple(p for p in PRIVILEGES if p in wanted)


def granted(
    grants: Iterable[Grant], grantee: str, privileges: Iterable[str], account: str = ""
) -> tuple[Grant, ...]:
    """``grants`` with ``privileges`` given to ``grantee`` (once each, sorted)."""
    kept = set(grants)
    kept.update((grantee, privilege, account) for privilege in privileges)
    return tuple(sorted(kept))


def revoked(grants: Iterable[Grant], grantee: str, privileges: Iterable[str]) -> tuple[Grant, ...]:
    """``grants`` without ``privileges`` for ``grantee`` (whatever their account id)."""
    gone = set(privileges)
    return tuple(g for g in grants if not (g[0] == grantee and g[1] in gone))
