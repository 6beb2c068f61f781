"""The DML gate's fast sample (``make conformance ARGS=--dml`` runs every file): DuckDB's own
tests of DELETE and UPDATE, their statements run in DuckDB and in shardflow alike on a real
3-worker cluster, each statement's count of changed rows compared, and the queries after it
comparing the tables' content (shardflow's copy is not loaded again after a statement it
ran). No case may be wrong. Skipped, with the reason, where the corpus is not checked out."""

from __future__ import annotations

import pytest

from tests.conformance.backends import ClusterBackend
from tests.conformance.runner import (
    DML_CORPUS_ENV,
    EQUAL,
    WRONG,
    dml_corpus_dir,
    dml_sample,
    list_files,
    run_files,
)

pytestmark = pytest.mark.cluster
VERBS = ("DELETE", "UPDATE")


def test_duckdbs_own_tests_of_row_changes_get_duckdbs_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = dml_corpus_dir()
    if root is None:
        pytest.skip(
            "the peer DML corpus is not checked out: it is read from "
            f"../shared/peer-sql/duckdb-dml/test/sql beside the repository, or ${DML_CORPUS_ENV}"
        )
    files = dml_sample(list_files(root))
    assert files, f"no .test files under {root}"
    backend = ClusterBackend(workers=3)
    try:
        report = run_files(files, root, backend, changes=True)
    finally:
        backend.close()
    lines: list[str] = []
    report.render(lines.append, max_listed=50)
    changed = [c for c in report.cases if c.status == EQUAL and c.sql.lstrip()[:6].upper() in VERBS]
    with capsys.disabled():
        print(
            f"\n{len(files)} DML sample files: {report.summary_line()} "
            f"({len(changed)} of the equal cases are DELETEs and UPDATEs)"
        )
    assert report.count(WRONG) == 0, "\n".join(lines)
    assert len(changed) > 10, "the statements themselves ran in shardflow"
