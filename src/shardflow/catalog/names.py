"""How names of tables and columns match: DuckDB's rule, in one function.

DuckDB compares identifiers (quoted or not) with the ASCII letters ``A``-``Z`` folded to
``a``-``z`` and every other character as it is: ``lineitem``, ``LINEITEM`` and
``"LineItem"`` name one table, while ``"Straße"`` and ``"STRASSE"``, or ``"Äpfel"`` and
``"äpfel"``, name different ones (checked against DuckDB 2.0, see
``tests/unit/test_names.py``). A name keeps the spelling it was created with; only lookups
and duplicate checks go through :func:`name_key`.

>>> name_key("LineItem") == name_key("lineitem")
True
>>> name_key("Straße") == name_key("STRASSE"), name_key("Äpfel") == name_key("äpfel")
(False, False)
"""

from __future__ import annotations

import string
from collections.abc import Iterable

_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def name_key(name: str) -> str:
    """The form under which two table or column names are the same name (DuckDB's rule:
    ASCII letters compare case-insensitively, every other character exactly)."""
    return name.translate(_ASCII_LOWER)


def find_name(names: Iterable[str], name: str) -> str | None:
    """The one of ``names`` that ``name`` refers to, spelled as it was created, or None."""
    key = name_key(name)
    return next((candidate for candidate in names if name_key(candidate) == key), None)


def duplicate_names(names: Iterable[str]) -> list[str]:
    """Names that repeat an earlier one under :func:`name_key`, in order."""
    seen: set[str] = set()
    repeated = []
    for name in names:
        key = name_key(name)
        if key in seen:
            repeated.append(name)
        seen.add(key)
    return repeated
