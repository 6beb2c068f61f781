"""The fast sample of the conformance gate (``make conformance`` runs every file): the
sample's files (:func:`sample_files`) through the same runner, on a real 3-worker cluster.
No answer may be wrong. Skipped, with the reason, where the corpus is not checked out."""

from __future__ import annotations

import pytest

from tests.conformance.backends import ClusterBackend
from tests.conformance.runner import (
    CORPUS_ENV,
    WRONG,
    corpus_dir,
    list_files,
    run_files,
    sample_files,
)

pytestmark = pytest.mark.cluster


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
    assert files, f"no .test files under {root}"
    backend = ClusterBackend(workers=3)
    try:
        report = run_files(files, root, backend)
    finally:
        backend.close()
    lines: list[str] = []
    report.render(lines.append, max_listed=50)
    with capsys.disabled():
        print(f"\n{len(files)} sample files: {report.summary_line()}")
    assert report.count(WRONG) == 0, "\n".join(lines)
