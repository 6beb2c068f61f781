"""Online backups and restores of a data directory: ``shardflow backup``, ``shardflow backup
verify|list`` and ``shardflow restore``. They read and write files only (no Ray, no running
service needed): a backup reads the data directory while its cluster serves on."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.progress import DownloadColumn, Progress, SpinnerColumn, TransferSpeedColumn
from rich.table import Table

from shardflow.cli.common import app, console, status

backup_app = typer.Typer(
    help="Back a data directory up while its cluster serves; check and list backups.",
    no_args_is_help=False,
    invoke_without_command=True,
)
app.add_typer(backup_app, name="backup")

DataDirUri = Annotated[
    str, typer.Option("--data-dir", help="Data directory (a folder or a filesystem URI).")
]
Root = Annotated[str, typer.Argument(help="The backups' folder or filesystem URI.")]


@contextmanager
def _bytes_progress(what: str) -> Iterator[Callable[[int], None]]:
    """A bytes counter with its speed on standard error (shown on a terminal only)."""
    with Progress(
        SpinnerColumn(),
        *Progress.get_default_columns()[:1],
        DownloadColumn(),
        TransferSpeedColumn(),
        console=status,
        transient=True,
        disable=not status.is_terminal,
    ) as progress:
        task = progress.add_task(what, total=None)
        yield lambda n: progress.advance(task, n)


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


@backup_app.callback()
def backup(
    ctx: typer.Context,
    data_dir: DataDirUri = ".shardflow",
    to: Annotated[
        str | None,
        typer.Option(
            help="The backups' folder or filesystem URI: chunks a backup there holds already "
            "are not written again (the next backup is incremental)."
        ),
    ] = None,
    priority: Annotated[
        str,
        typer.Option(
            help="CPU priority of the copy: idle (only where nothing else runs: queries keep "
            "their latency), low (lowest nice value) or normal."
        ),
    ] = "idle",
    max_rate_mb_s: Annotated[
        float, typer.Option(min=0, help="Cap on the megabytes read a second (0: none).")
    ] = 0.0,
    keep_log: Annotated[
        bool,
        typer.Option(
            "--keep-log",
            help="Keep the data directory's log from now on (checkpoints archive what they "
            "cover until the next backup takes it), so that `restore --as-of` can restore "
            "any time between two backups. Once on, it stays on.",
        ),
    ] = False,
) -> None:
    """Back up every table of a data directory, as of one point in time, while its cluster
    serves queries, inserts and moves."""
    if ctx.invoked_subcommand is not None:
        return
    if to is None:
        raise typer.BadParameter("where to: --to FOLDER_OR_URI", param_hint="--to")
    from shardflow.catalog import DataDir
    from shardflow.errors import StorageError
    from shardflow.storage import backup as backups

    if "://" not in data_dir and not os.path.isdir(data_dir):
        raise StorageError(f"{data_dir!r} holds no shardflow data (no such folder)")
    with _bytes_progress("backing up") as progress:
        info = backups.backup(
            DataDir.resolve(data_dir),
            to,
            progress,
            priority=priority,
            max_rate_mb_s=max_rate_mb_s,
            keep_log=keep_log,
        )
    took = info.finished_at - info.started_at
    console.print(
        f"backup {info.backup_id}: {info.tables} tables, {info.files} files, "
        f"{info.bytes / 1e6:.1f} MB ({info.bytes_written / 1e6:.1f} MB new) in {took:.1f} s"
    )


@backup_app.command("verify")
def verify(
    root: Root,
    backup_id: Annotated[
        str | None, typer.Option("--id", help="One backup (default: every one).")
    ] = None,
) -> None:
    """Check backups: each manifest against its checksum, every chunk against its sha256.
    Exits 1 where anything does not match."""
    from shardflow.storage import backup as backups

    with _bytes_progress("checking") as progress:
        report = backups.verify(root, backup_id, progress)
    for problem in report.problems:
        console.print(f"[red]bad:[/red] {problem}", soft_wrap=True)
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    console.print(
        f"{report.backups} backup(s), {report.chunks} chunks, {report.bytes / 1e6:.1f} MB "
        f"checked: {verdict}"
    )
    if not report.ok:
        raise typer.Exit(1)


@backup_app.command("prune")
def prune(
    root: Root,
    keep: Annotated[int, typer.Option(min=1, help="The newest backups to keep.")],
) -> None:
    """Delete all but the newest backups of a folder, and the packs no kept backup names
    (refused while a backup runs there)."""
    from shardflow.storage import backup as backups

    report = backups.prune(root, keep)
    console.print(
        f"removed {len(report.backups)} backup(s) and {report.packs} pack(s): "
        f"{report.bytes / 1e6:.1f} MB freed"
    )


@backup_app.command("list")
def list_backups(root: Root) -> None:
    """The backups of a folder, oldest first."""
    from shardflow.storage import backup as backups

    found = backups.open_root(root, create=False)
    table = Table("id", "taken (UTC)", "tables", "files", "MB", "new MB")
    for backup_id in backups.backups(found):
        info = backups.info_of(backups.read_manifest(found, backup_id))
        table.add_row(
            info.backup_id,
            _when(info.finished_at),
            str(info.tables),
            str(info.files),
            f"{info.bytes / 1e6:.1f}",
            f"{info.bytes_written / 1e6:.1f}",
        )
    console.print(table)


@app.command()
def restore(
    source: Annotated[str, typer.Option("--from", help="The backups' folder or URI.")],
    data_dir: Annotated[
        str,
        typer.Option("--data-dir", help="A new data directory (folder or URI) to restore into."),
    ],
    backup_id: Annotated[
        str | None, typer.Option("--id", help="Which backup (default: the newest).")
    ] = None,
    as_of: Annotated[
        str | None,
        typer.Option(
            "--as-of",
            help="Restore the data as it was at this time (ISO 8601, UTC unless it says "
            "otherwise: 2026-12-07T12:30:00Z), between two backups taken with the log kept "
            "(`backup --keep-log`).",
        ),
    ] = None,
) -> None:
    """Restore a backup into a new data directory; start a cluster of any size on it."""
    from shardflow.catalog import DataDir
    from shardflow.storage import backup as backups

    at = None if as_of is None else _time_of(as_of)
    backups.open_root(source, create=False)  # no backups there: no new folder made either
    with _bytes_progress("restoring") as progress:
        info = backups.restore(source, DataDir.resolve(data_dir), backup_id, progress, as_of=at)
    what = (
        f"backup {info.backup_id} (taken {_when(info.finished_at)} UTC)"
        if at is None
        else f"the data as of {_when(at)} UTC (backup {info.backup_id} and the log after it)"
    )
    console.print(
        f"restored {what}: {info.tables} tables, {info.bytes / 1e6:.1f} MB into {data_dir}"
    )


def _time_of(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time (UTC where it names no zone)."""
    try:
        found = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not a time: ISO 8601, as 2026-12-07T12:30:00Z", param_hint="--as-of"
        ) from None
    if found.tzinfo is None:
        found = found.replace(tzinfo=datetime.UTC)
    return found.timestamp()
