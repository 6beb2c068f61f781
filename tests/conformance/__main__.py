"""``python -m tests.conformance``: DuckDB's sqllogictest corpus against shardflow.

Reads the corpus from ``$SHARDFLOW_PEER_SQL`` or ``../shared/peer-sql/duckdb/test/sql``
beside the repository (with ``--dml``: DuckDB's tests of row changes, from
``$SHARDFLOW_PEER_SQL_DML`` or ``../shared/peer-sql/duckdb-dml/test/sql``, their DELETEs
and UPDATEs run in shardflow too), runs every file (or ``--sample``, or the ``--files``
patterns) on one real 3-worker cluster (its balancer as ``--balancer`` says), prints the
skip rules, the unsupported messages, every wrong case, and last ``conformance: N/M equal,
U unsupported, W wrong, S skipped``. Exits 1 if W > 0, 2 if the corpus is missing.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path

from tests.conformance.backends import BALANCERS, make_backend
from tests.conformance.runner import (
    CORPUS_ENV,
    DML_CORPUS_ENV,
    WRONG,
    corpus_dir,
    dml_corpus_dir,
    dml_sample,
    list_files,
    run_files,
    sample_files,
    write_json,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__)
    parser.add_argument(
        "--corpus",
        type=Path,
        help=f"the corpus folder (default: ${CORPUS_ENV} or ../shared/peer-sql/duckdb/test/sql)",
    )
    parser.add_argument("--json", type=Path, help="write the full report (every case) here")
    parser.add_argument(
        "--backend",
        choices=("cluster", "process", "inmemory"),
        default="cluster",
        help="a real local cluster on Ray (default), the same cluster in this process "
        "without Ray (connect(in_process=True)), or the planner over in-memory shards",
    )
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--query-timeout",
        type=float,
        default=60.0,
        help="seconds before a shardflow query counts as wrong and the cluster restarts",
    )
    parser.add_argument(
        "--balancer",
        choices=sorted(BALANCERS),
        default="default",
        help="the cluster's balancer: default, or one that keeps splitting (or merging and "
        "moving) units every 0.3 s while the files run",
    )
    parser.add_argument("--sample", action="store_true", help="only the fast sample of files")
    parser.add_argument(
        "--dml",
        action="store_true",
        help="DuckDB's tests of DELETE and UPDATE, each statement run in shardflow too",
    )
    parser.add_argument(
        "--files",
        nargs="*",
        default=[],
        help="glob patterns of corpus-relative paths, e.g. 'join/*'",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (CI logs)")
    args = parser.parse_args(argv)

    default = dml_corpus_dir() if args.dml else corpus_dir()
    root = args.corpus if args.corpus is not None else default
    if root is None or not root.is_dir():
        wanted = DML_CORPUS_ENV if args.dml else CORPUS_ENV
        print(f"conformance: corpus not found (set {wanted})", file=sys.stderr)
        return 2
    files = list_files(root)
    if args.sample:
        files = dml_sample(files) if args.dml else sample_files(files)
    if args.files:
        files = [
            f
            for f in files
            if any(fnmatch.fnmatch(f.relative_to(root).as_posix(), p) for p in args.files)
        ]
    started = time.perf_counter()
    backend = make_backend(args.backend, args.workers, args.query_timeout, args.balancer)
    try:
        if args.no_progress:
            seen = 0

            def note(rel: str) -> None:  # a line now and then, for CI logs
                nonlocal seen
                seen += 1
                if seen % 50 == 1:
                    print(f"[{seen}/{len(files)}] {rel}", file=sys.stderr, flush=True)

            report = run_files(files, root, backend, progress=note, changes=args.dml)
        else:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            ) as bar:
                task = bar.add_task("conformance", total=len(files))
                seen = 0

                def step(rel: str) -> None:
                    nonlocal seen
                    bar.update(task, completed=seen, description=rel[-60:])
                    seen += 1

                report = run_files(files, root, backend, progress=step, changes=args.dml)
                bar.update(task, completed=len(files))
    finally:
        backend.close()
    elapsed = time.perf_counter() - started
    if args.json is not None:
        write_json(report, args.json)
    print(f"{len(files)} files on the {backend.name} backend in {elapsed:.0f} s")
    report.render(print)
    return 1 if report.count(WRONG) else 0


if __name__ == "__main__":
    sys.exit(main())
