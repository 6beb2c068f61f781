"""The conformance runner's own parts: the sqllogictest parser, the comparison rules, the
layouts, and the classification of one file end to end against a fake shardflow (no Ray,
no corpus)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from tests.conformance.analysis import analyze, join_edges, without_limit
from tests.conformance.backends import InMemoryBackend
from tests.conformance.layouts import plan_layouts
from tests.conformance.runner import (
    EQUAL,
    SKIPPED,
    UNSUPPORTED,
    WRONG,
    Report,
    compare,
    run_files,
    sample_files,
)
from tests.conformance.slt import Command, Query, SltParseError, Statement, expand, parse
from tests.support.oracle import assert_limited_result, assert_same_values

SAMPLE = """\
# name: test/sql/example.test
# group: [example]

require vector_size 512

statement ok
CREATE TABLE t(i INTEGER, s VARCHAR);

statement error
SELECT nope FROM t
----
Binder Error

skipif duckdb
query I
SELECT 1
----
1

query IT rowsort label1
SELECT i, s
FROM t
----
1	a
2	b

mode skip

query I valuesort
SELECT 2
----
2

mode unskip

foreach ty INTEGER BIGINT

query I
SELECT 1::${ty} + {ty_free}
----

endloop
"""


def test_parser_reads_every_record_kind() -> None:
    records = parse(SAMPLE, "example.test")
    kinds = [type(r).__name__ for r in records]
    assert kinds == [
        "Command",
        "Statement",
        "Statement",
        "Query",
        "Query",
        "Command",
        "Query",
        "Command",
        "Command",
        "Query",
        "Command",
    ]
    require, create, error, skipped, rows = records[:5]
    assert isinstance(require, Command) and require.args == ("vector_size", "512")
    assert isinstance(create, Statement) and create.expect == "ok" and create.line == 6
    assert isinstance(error, Statement) and error.expect == "error"
    assert error.error == "Binder Error"
    assert isinstance(skipped, Query) and not skipped.conditions[0].runs_on("duckdb")
    assert isinstance(rows, Query)
    assert (rows.types, rows.sort, rows.label) == ("IT", "rowsort", "label1")
    assert rows.sql == "SELECT i, s\nFROM t" and rows.expected == ("1\ta", "2\tb")
    assert isinstance(records[6], Query) and records[6].sort == "valuesort"


def test_loops_unroll_and_substitute_both_spellings() -> None:
    flat = expand(parse(SAMPLE))
    queries = [r for r in flat if isinstance(r, Query)]
    assert [q.sql for q in queries[-2:]] == [
        "SELECT 1::INTEGER + {ty_free}",
        "SELECT 1::BIGINT + {ty_free}",
    ]
    nested = parse(
        "loop i 0 2\n\nforeach v <signed>\n\nstatement ok\nSELECT ${i}, {v}\n\nendloop\n\nendloop\n"
    )
    assert len(expand(nested)) == 10
    assert expand(nested)[-1].sql == "SELECT 1, hugeint"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text",
    [
        "statement maybe_not\nSELECT 1\n",
        "query X\nSELECT 1\n",
        "frobnicate\n",
        "skipif duckdb\n",
        "loop i 0 2\n\nstatement ok\nSELECT 1\n",
        "statement ok\n\n",
    ],
)
def test_parser_rejects_malformed_files(text: str) -> None:
    with pytest.raises(SltParseError):
        expand(parse(text))


def test_analysis_finds_tables_limits_and_joins() -> None:
    facts = analyze(
        "WITH c AS (SELECT * FROM u) SELECT t.a FROM t JOIN c ON t.k = c.k "
        "JOIN v ON t.a = v.b ORDER BY 1 LIMIT 2"
    )
    assert facts.tables == {"t", "u", "v"} and facts.ordered and facts.limited
    assert without_limit(facts) is not None and "LIMIT" not in (without_limit(facts) or "")
    edges = join_edges(facts, {"t": ["a", "k"], "u": ["k"], "v": ["b"]})
    assert [(e.left, e.left_column, e.right, e.right_column) for e in edges] == [
        ("t", "a", "v", "b")
    ]
    assert analyze("SELECT random() FROM t").volatile == {"rand"}
    assert analyze("SELECT * FROM range(3)").table_functions == {"generate_series"}
    assert analyze("SELECT * FROM s.t").qualified_tables == {"s.t"}
    assert analyze("SELECT * FROM read_csv('data/x.csv')").external_data


def test_join_keys_layout_colocates_joined_tables() -> None:
    schemas = {
        "a": pa.schema([("id", pa.int64()), ("k", pa.int32())]),
        "b": pa.schema([("k", pa.int64()), ("x", pa.string())]),
        "c": pa.schema([("x", pa.string())]),
    }
    plans = plan_layouts(schemas, ["SELECT * FROM a JOIN b USING (k)", "SELECT 1 = 1"])
    assert [p.name for p in plans] == ["first-column", "replicated", "join-keys"]
    join = plans[2]
    assert dict(join.keys) == {"a": "k", "b": "k"}
    assert join.place("a", schemas["a"], {}).distributed_by == "k"
    placed = join.place("b", schemas["b"], {"a": "a"})
    assert (placed.distributed_by, placed.colocate_with) == ("k", "a")
    assert join.place("c", schemas["c"], {"a": "a"}).colocate_with is None
    # no join: the join-keys layout would equal first-column and is left out
    assert len(plan_layouts(schemas, ["SELECT * FROM a WHERE id = 3"])) == 2


# --------------------------------------------------------------------------------------
# comparison


def _t(**cols: list[object]) -> pa.Table:
    return pa.table(cols)


def test_compare_follows_order_by_and_sort_modes() -> None:
    expected = _t(a=[1, 2, 2, 3], b=["w", "x", "y", "z"])
    shuffled = _t(a=[3, 2, 1, 2], b=["z", "y", "w", "x"])
    tie_swapped = _t(a=[1, 2, 2, 3], b=["w", "y", "x", "z"])
    unordered = analyze("SELECT a, b FROM t")
    ordered = analyze("SELECT a, b FROM t ORDER BY a")
    assert compare(shuffled, expected, unordered, "nosort") is None
    assert compare(shuffled, expected, ordered, "nosort") is not None
    assert compare(shuffled, expected, ordered, "rowsort") is None
    assert compare(tie_swapped, expected, ordered, "nosort") is None
    wrong = _t(a=[1, 2, 2, 3], b=["w", "x", "y", "Z"])
    for facts in (unordered, ordered):
        assert compare(wrong, expected, facts, "nosort") is not None
        assert compare(wrong, expected, facts, "rowsort") is not None
    assert compare(wrong.slice(0, 3), expected, unordered, "nosort") is not None


def test_valuesort_compares_cells_regardless_of_rows() -> None:
    assert_same_values(_t(a=[1, 4], b=[3, 2]), _t(a=[1, 2], b=[3, 4]))
    with pytest.raises(AssertionError):
        assert_same_values(_t(a=[1, 4], b=[3, 2]), _t(a=[1, 2], b=[3, 5]))


def test_limit_without_order_accepts_any_rows_of_the_answer() -> None:
    full = _t(a=[1, 2, 3, 4])
    facts = analyze("SELECT a FROM t LIMIT 2")
    assert compare(_t(a=[4, 2]), _t(a=[1, 2]), facts, "nosort", lambda: full) is None
    # a row not in the answer, a repeated row, or the wrong count is wrong
    for bad in ([5, 2], [2, 2], [1]):
        assert compare(_t(a=bad), _t(a=[1, 2]), facts, "nosort", lambda: full) is not None


def test_limit_with_ties_at_the_cut() -> None:
    full = _t(k=[1, 2, 2, 2, 3], v=["a", "b", "c", "d", "e"])
    expected = _t(k=[1, 2, 2], v=["a", "b", "c"])
    # rows tying on k at the cut may be any of the tied rows
    assert_limited_result(
        _t(k=[1, 2, 2], v=["a", "d", "b"]), expected, full, sort_keys=[0], ordered=True
    )
    with pytest.raises(AssertionError, match="key values differ"):
        assert_limited_result(
            _t(k=[2, 1, 2], v=["d", "a", "b"]), expected, full, sort_keys=[0], ordered=True
        )
    with pytest.raises(AssertionError):  # k=1 is complete: its row must be 'a'
        assert_limited_result(
            _t(k=[1, 2, 2], v=["z", "d", "b"]), expected, full, sort_keys=[0], ordered=True
        )
    with pytest.raises(AssertionError):  # the same tied row twice
        assert_limited_result(
            _t(k=[1, 2, 2], v=["a", "b", "b"]), expected, full, sort_keys=[0], ordered=True
        )


# --------------------------------------------------------------------------------------
# one file end to end, against a shardflow stand-in


class FakeShardflow(InMemoryBackend):
    """The in-process cluster, with answers to chosen queries replaced."""

    def __init__(self, answers: dict[str, object]) -> None:
        super().__init__()
        self.answers = answers

    def sql(self, query: str) -> pa.Table:
        for needle, answer in self.answers.items():
            if needle in query:
                if isinstance(answer, Exception):
                    raise answer
                return answer  # type: ignore[return-value]
        return super().sql(query)


FILE = """\
statement ok
CREATE TABLE t AS SELECT range AS i, range % 3 AS g FROM range(10)

statement ok
CREATE TABLE u AS SELECT range AS g, 'n' || range AS name FROM range(3)

query II
SELECT g, count(*) FROM t GROUP BY g /* right */
----

query I
SELECT sum(i) FROM t /* wrong */
----

query I
SELECT max(i) FROM t /* unsupported */
----

query I
SELECT count(*) FROM t JOIN u USING (g)
----

statement ok
INSERT INTO t VALUES (100, 1)

query II
SELECT g, sum(i) FROM t GROUP BY ALL ORDER BY g
----

query I
SELECT random() FROM t
----

query I
SELECT nope FROM t
----

query I
SELECT i FROM t LIMIT 3
----

query I
SELECT list(i) FROM t
----

query I
SELECT 40 + 2
----
"""


def test_a_wrong_answer_is_classified_wrong(tmp_path: Path) -> None:
    from shardflow.errors import UnsupportedError

    (tmp_path / "f.test").write_text(FILE)
    fake = FakeShardflow(
        {
            "/* wrong */": pa.table({"s": [44]}),
            "/* unsupported */": UnsupportedError("not yet"),
            "SELECT list(i)": pa.table({"l": [[100, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]]}),
        }
    )
    report = run_files([tmp_path / "f.test"], tmp_path, fake)
    by_line: dict[int, set[str]] = {}
    for case in report.cases:
        by_line.setdefault(case.line, set()).add(case.status)
    layouts = {c.layout for c in report.cases if c.status != SKIPPED}
    assert layouts == {"first-column", "replicated", "join-keys", "no tables"}
    assert by_line[7] == {EQUAL}  # right in every layout
    assert by_line[11] == {WRONG}
    assert by_line[15] == {UNSUPPORTED}
    assert by_line[19] == {EQUAL}
    assert by_line[26] == {EQUAL}  # after the INSERT: the copy was reloaded
    assert by_line[30] == {SKIPPED}  # random()
    assert by_line[34] == {SKIPPED}  # DuckDB rejects it
    assert by_line[38] == {EQUAL}  # any 3 rows will do
    assert by_line[42] == {EQUAL}  # list() without ORDER BY: a permuted DuckDB answer
    assert by_line[46] == {EQUAL}
    assert len([c for c in report.cases if c.line == 46]) == 1  # reads no table: once
    wrong = next(c for c in report.cases if c.status == WRONG)
    assert "44" in " ".join(wrong.actual or []) and wrong.expected
    assert report.count(WRONG) == 3 and report.count(UNSUPPORTED) == 3
    rules = report.skip_rules()
    assert rules == {"volatile function": 1, "duckdb error": 1}
    lines: list[str] = []
    report.render(lines.append)
    n, m = report.count(EQUAL), report.count(EQUAL) + 6
    assert lines[-1] == f"conformance: {n}/{m} equal, 3 unsupported, 3 wrong, 2 skipped"
    assert any("f.test:11 [first-column] SELECT sum(i)" in line for line in lines)


def test_files_needing_what_the_oracle_lacks_are_skipped_whole(tmp_path: Path) -> None:
    (tmp_path / "a.test").write_text("require tpcds\n\nquery I\nSELECT 1\n----\n1\n")
    (tmp_path / "b.test").write_text("load x.db\n\nquery I\nSELECT 1\n----\n1\n")
    (tmp_path / "c.test").write_text("query I\nSELECT 1\n")
    (tmp_path / "d.test").write_text("frobnicate\n\nquery I\nSELECT 1\n----\n1\n")
    files = sorted(tmp_path.glob("*.test"))
    report = run_files(files, tmp_path, FakeShardflow({}))
    assert dict(report.skipped_files) == {
        "require tpcds": 1,
        "persistent database": 1,
        "unparsable file": 1,
    }
    assert report.count(SKIPPED) == 3 and report.count(EQUAL) == 1


def test_an_order_dependent_answer_is_not_counted_equal(tmp_path: Path) -> None:
    (tmp_path / "f.test").write_text(
        "statement ok\nCREATE TABLE t AS SELECT range AS i FROM range(5)\n\n"
        "query I\nSELECT list(i) FROM t\n----\n"
    )
    fake = FakeShardflow({"list(i)": pa.table({"l": [[0, 2, 1, 3, 4]]})})
    report = run_files([tmp_path / "f.test"], tmp_path, fake)
    assert {c.status for c in report.cases} == {SKIPPED}
    assert report.skip_rules() == {"order-dependent answer": 2}


def test_sample_rule_is_every_kth_file() -> None:
    files = [Path(f"{i:03d}.test") for i in range(30)]
    assert sample_files(files, every=12) == [files[0], files[12], files[24]]


def test_report_json_is_plain_data() -> None:
    report = Report()
    data = report.to_json()
    assert data["summary"] == "conformance: 0/0 equal, 0 unsupported, 0 wrong, 0 skipped"
    assert duckdb.__version__.startswith("2.")  # the oracle the project pins


def test_a_table_recreated_with_other_data_is_reloaded(tmp_path: Path) -> None:
    # DuckDB's hash() gives NULL and [NULL] the same value: the copy must still be reloaded
    (tmp_path / "f.test").write_text(
        "statement ok\nCREATE TABLE t AS SELECT [range] AS l FROM range(5) "
        "UNION ALL SELECT NULL\n\n"
        "query I\nSELECT l FROM t ORDER BY l NULLS FIRST LIMIT 2\n----\n\n"
        "statement ok\nCREATE OR REPLACE TABLE t AS SELECT [range] AS l FROM range(5) "
        "UNION ALL SELECT [NULL]\n\n"
        "query I\nSELECT l FROM t ORDER BY l NULLS FIRST LIMIT 2\n----\n"
    )
    report = run_files([tmp_path / "f.test"], tmp_path, FakeShardflow({}))
    assert {c.status for c in report.cases} == {EQUAL}


def test_a_collated_table_is_skipped_by_rule(tmp_path: Path) -> None:
    (tmp_path / "f.test").write_text(
        "statement ok\nCREATE TABLE t(a VARCHAR COLLATE NOCASE)\n\n"
        "statement ok\nINSERT INTO t VALUES ('A'), ('a')\n\n"
        "query I\nSELECT DISTINCT a FROM t\n----\n"
    )
    report = run_files([tmp_path / "f.test"], tmp_path, FakeShardflow({}))
    rule = "collated column (Arrow columns carry no collation)"
    assert set(report.skip_rules()) == {rule} and {c.status for c in report.cases} == {SKIPPED}


def test_every_balancer_the_gate_offers_is_valid_settings_and_others_are_refused() -> None:
    from shardflow.config import Settings
    from tests.conformance.backends import BALANCERS, ClusterBackend

    for settings in BALANCERS.values():
        Settings(initial_shard_bytes=0, **settings)  # type: ignore[arg-type]  # or ConfigError
    with pytest.raises(ValueError, match="unknown balancer 'busy'"):
        ClusterBackend(balancer="busy")
