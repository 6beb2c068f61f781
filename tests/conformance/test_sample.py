"""The fast samples of the conformance gates (``make conformance`` runs every file, and
``make conformance ARGS=--dml`` every file of row changes): the sample's files through the
same runner, on a real 3-worker cluster. No case may be wrong. Skipped, with the reason,
where a corpus is not checked out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.backends import ClusterBackend
from tests.conformance.runner import (
    CORPUS_ENV,
    DML_CORPUS_ENV,
    EQUAL,
    WRONG,
    Report,
    corpus_dir,
    dml_corpus_dir,
    dml_sample,
    list_files,
    run_files,
    sample_files,
)

pytestmark = pytest.mark.cluster


def gate(files: list[Path], root: Path, changes: bool) -> tuple[Report, str]:
    """Run ``files`` on a fresh 3-worker cluster: the report, and its rendering."""
    assert files, f"no .test files under {root}"
    backend = ClusterBackend(workers=3)
    try:
        report = run_files(files, root, backend, changes=changes)
    finally:
        backend.close()
    lines: list[str] = []
    report.render(lines.append, max_listed=50)
    return report, "\n".join(lines)


def test_a_sample_of_duckdbs_own_tests_gets_duckdbs_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = corpus_dir()
    if root is None:
        pytest.skip(
            "the peer SQL corpus is not checked out: it is read from "
            f"../shared/peer-sql/duckdb/test/sql beside the repository, or ${CORPUS_ENV}"
        )
    files = sample_files(list_files(root))
    report, rendered = gate(files, root, changes=False)
    with capsys.disabled():
        print(f"\n{len(files)} sample files: {report.summary_line()}")
    assert report.count(WRONG) == 0, rendered


def test_duckdbs_own_tests_of_row_changes_get_duckdbs_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each DELETE and UPDATE runs in DuckDB and in shardflow alike, its count of changed
    rows compared, and the queries after it compare the table's content (shardflow's
    copy is not loaded again after a statement it ran)."""
    root = dml_corpus_dir()
    if root is None:
        pytest.skip(
            "the peer DML corpus is not checked out: it is read from "
            f"../shared/peer-sql/duckdb-dml/test/sql beside the repository, or ${DML_CORPUS_ENV}"
        )
    files = dml_sample(list_files(root))
    report, rendered = gate(files, root, changes=True)
    verbs = ("DELETE", "UPDATE")
    changed = [c for c in report.cases if c.status == EQUAL and c.sql.lstrip()[:6].upper() in verbs]
    with capsys.disabled():
        print(
            f"\n{len(files)} DML sample files: {report.summary_line()} "
            f"({len(changed)} of the equal cases are DELETEs and UPDATEs)"
        )
    assert report.count(WRONG) == 0, rendered
    assert len(changed) > 10, "the statements themselves ran in shardflow"
