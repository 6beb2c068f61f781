"""Read sqllogictest files (DuckDB's dialect of the format) into records, and unroll loops.

No maintained parser of this format is on PyPI, so this is a small one. A file is a sequence
of records separated by blank lines; ``#`` starts a comment line::

    statement ok                  statement error           query IT rowsort [label]
    CREATE TABLE t(i INT)         SELECT 1 +                SELECT i, s FROM t
                                  ----                      ----
                                  <message>                 1	a

and one-line commands (``require``, ``mode skip``, ``loop i 0 10``, ``foreach v a b``,
``endloop``, ``halt``, ``load``, ``restart``, ...). ``skipif X`` / ``onlyif X`` lines
decorate the record that follows them.

>>> records = parse("query I\\nSELECT 1\\n----\\n1\\n")
>>> records[0].sql, records[0].expected
('SELECT 1', ('1',))
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "Command",
    "Query",
    "Record",
    "SltParseError",
    "Statement",
    "expand",
    "parse",
]

SORT_MODES = frozenset({"nosort", "rowsort", "valuesort", "sort"})
"""``sort`` is DuckDB's older spelling of ``rowsort``."""

COMMANDS = frozenset(
    {
        "require",
        "require-env",
        "mode",
        "halt",
        "hash-threshold",
        "load",
        "restart",
        "reconnect",
        "sleep",
        "set",
        "unzip",
        "include",
        "tags",
        "loop",
        "foreach",
        "concurrentloop",
        "concurrentforeach",
        "endloop",
    }
)

# The named value lists of DuckDB's runner (sqllogic_test_runner.cpp) for ``foreach``.
_SIGNED = ("tinyint", "smallint", "integer", "bigint", "hugeint")
_UNSIGNED = ("utinyint", "usmallint", "uinteger", "ubigint", "uhugeint")
FOREACH_COLLECTIONS: dict[str, tuple[str, ...]] = {
    "<signed>": _SIGNED,
    "<unsigned>": _UNSIGNED,
    "<integral>": _SIGNED + _UNSIGNED,
    "<numeric>": (*_SIGNED, *_UNSIGNED, "float", "double"),
    "<alltypes>": ("bool", "interval", "varchar"),
}


class SltParseError(ValueError):
    """The text is not a well-formed sqllogictest file; the message names the line."""


@dataclass(frozen=True)
class Condition:
    """``skipif ENGINE`` (``only=False``) or ``onlyif ENGINE`` (``only=True``)."""

    only: bool
    engine: str

    def runs_on(self, engine: str) -> bool:
        return (self.engine.lower() == engine) == self.only


@dataclass(frozen=True)
class Statement:
    """``statement ok|error|maybe``: SQL that must succeed, fail, or either."""

    line: int
    expect: str
    sql: str
    error: str | None = None
    connection: str | None = None
    conditions: tuple[Condition, ...] = ()


@dataclass(frozen=True)
class Query:
    """``query TYPES [SORT] [LABEL]``: SQL whose result is listed after ``----``."""

    line: int
    types: str
    sort: str
    sql: str
    expected: tuple[str, ...] = ()
    label: str | None = None
    conditions: tuple[Condition, ...] = ()


@dataclass(frozen=True)
class Command:
    """A one-line command: ``name`` and its whitespace-separated ``args``."""

    line: int
    name: str
    args: tuple[str, ...] = field(default_factory=tuple)
    conditions: tuple[Condition, ...] = ()


Record = Statement | Query | Command


def _is_blank_or_comment(line: str) -> bool:
    return not line.strip() or line.startswith("#")


def parse(text: str, name: str = "<text>") -> list[Record]:
    """The records of one file, in order. Raises :class:`SltParseError`."""
    lines = text.replace("\r", "").split("\n")
    records: list[Record] = []
    conditions: list[Condition] = []
    i = 0
    while i < len(lines):
        if _is_blank_or_comment(lines[i]):
            if conditions and not lines[i].strip():
                raise SltParseError(f"{name}:{i + 1}: skipif/onlyif not followed by a record")
            i += 1
            continue
        words = lines[i].split()
        head, args, line_no = words[0], tuple(words[1:]), i + 1
        if head in ("skipif", "onlyif"):
            if len(args) != 1:
                raise SltParseError(f"{name}:{line_no}: {head} takes one engine name")
            conditions.append(Condition(head == "onlyif", args[0]))
            i += 1
            continue
        if head == "statement":
            if not args or args[0] not in ("ok", "error", "maybe"):
                raise SltParseError(f"{name}:{line_no}: statement ok|error|maybe expected")
            sql, i = _take_sql(lines, i + 1)
            error_lines, i = _take_result(lines, i)
            if not sql:
                raise SltParseError(f"{name}:{line_no}: statement without SQL")
            records.append(
                Statement(
                    line_no,
                    args[0],
                    sql,
                    "\n".join(error_lines) if error_lines is not None else None,
                    args[1] if len(args) > 1 else None,
                    tuple(conditions),
                )
            )
        elif head == "query":
            if not args or not re.fullmatch(r"[ITR]+", args[0]):
                raise SltParseError(f"{name}:{line_no}: query needs column types such as III")
            sort, label = "nosort", None
            rest = list(args[1:])
            if rest and rest[0] in SORT_MODES:
                sort = "rowsort" if rest.pop(0) == "sort" else args[1]
            if rest:
                label = rest[0]
            sql, i = _take_sql(lines, i + 1)
            result, i = _take_result(lines, i)
            if not sql:
                raise SltParseError(f"{name}:{line_no}: query without SQL")
            records.append(
                Query(line_no, args[0], sort, sql, tuple(result or ()), label, tuple(conditions))
            )
        elif head in COMMANDS:
            records.append(Command(line_no, head, args, tuple(conditions)))
            i += 1
        else:
            raise SltParseError(f"{name}:{line_no}: unknown record {head!r}")
        conditions = []
    if conditions:
        raise SltParseError(f"{name}: skipif/onlyif at the end of the file")
    return records


def _take_sql(lines: Sequence[str], i: int) -> tuple[str, int]:
    """SQL lines up to a blank line, a comment line or ``----``."""
    sql: list[str] = []
    while i < len(lines) and not _is_blank_or_comment(lines[i]) and lines[i].strip() != "----":
        sql.append(lines[i])
        i += 1
    return "\n".join(sql).strip(), i


def _take_result(lines: Sequence[str], i: int) -> tuple[list[str] | None, int]:
    """After ``----``: the lines up to the next blank line; None without ``----``."""
    if i >= len(lines) or lines[i].strip() != "----":
        return None, i
    i += 1
    out: list[str] = []
    while i < len(lines) and lines[i].strip():
        out.append(lines[i])
        i += 1
    return out, i


# --------------------------------------------------------------------------------------
# loops


def _loop_values(command: Command) -> list[str]:
    if command.name in ("loop", "concurrentloop"):
        if len(command.args) != 3:
            raise SltParseError(f"line {command.line}: loop NAME START END expected")
        start, end = int(command.args[1]), int(command.args[2])
        return [str(v) for v in range(start, end)]
    if len(command.args) < 2:
        raise SltParseError(f"line {command.line}: foreach NAME VALUE... expected")
    values: list[str] = []
    for value in command.args[1:]:
        values.extend(FOREACH_COLLECTIONS.get(value.lower(), (value,)))
    return values


def substitute(text: str, variables: dict[str, str]) -> str:
    """Replace ``${name}`` and ``{name}`` of the loop variables in scope."""
    for name, value in variables.items():
        text = text.replace("${" + name + "}", value).replace("{" + name + "}", value)
    return text


def _substituted(record: Record, variables: dict[str, str]) -> Record:
    if not variables:
        return record
    if isinstance(record, Statement | Query):
        return replace(record, sql=substitute(record.sql, variables))
    return replace(record, args=tuple(substitute(a, variables) for a in record.args))


def expand(records: Sequence[Record], variables: dict[str, str] | None = None) -> list[Record]:
    """Unroll ``loop`` / ``foreach`` (and their ``concurrent`` forms, run one after the
    other) into a flat list, substituting the loop variables into SQL and arguments.

    >>> recs = parse("loop i 0 2\\n\\nquery I\\nSELECT ${i}\\n----\\n\\nendloop\\n")
    >>> [r.sql for r in expand(recs)]
    ['SELECT 0', 'SELECT 1']
    """
    out, end = _expand(list(records), 0, dict(variables or {}))
    if end != len(records):
        raise SltParseError(f"line {records[end].line}: endloop without loop")
    return out


def _expand(records: list[Record], i: int, variables: dict[str, str]) -> tuple[list[Record], int]:
    out: list[Record] = []
    while i < len(records):
        record = records[i]
        if isinstance(record, Command) and record.name == "endloop":
            return out, i
        if isinstance(record, Command) and record.name in (
            "loop",
            "foreach",
            "concurrentloop",
            "concurrentforeach",
        ):
            body_end = _matching_endloop(records, i)
            values = _loop_values(_substituted(record, variables))  # type: ignore[arg-type]
            for value in values:
                body, _ = _expand(records, i + 1, {**variables, record.args[0]: value})
                out.extend(body)
            i = body_end + 1
            continue
        out.append(_substituted(record, variables))
        i += 1
    return out, i


def _matching_endloop(records: Sequence[Record], start: int) -> int:
    depth = 0
    for j in range(start, len(records)):
        record = records[j]
        if isinstance(record, Command):
            if record.name in ("loop", "foreach", "concurrentloop", "concurrentforeach"):
                depth += 1
            elif record.name == "endloop":
                depth -= 1
                if depth == 0:
                    return j
    raise SltParseError(f"line {records[start].line}: loop without endloop")


def iter_queries(records: Sequence[Record]) -> Iterator[Query]:
    return (r for r in records if isinstance(r, Query))
