"""The GPU stack (shardflow[gpu-cu13]: Polars, cudf-polars, libcudf, RMM and their CUDA 13
libraries, about 1 GB unpacked) carried to a GPU machine that has no package index and
takes files only in parts of at most 64 MiB (docs/gpu.md says how a run goes).

Here, with the package index:

    python bench/carry.py pack --out .carry            # parts .carry/part-000 ... + manifest

Each part then travels on its own; on the GPU machine, once all are there:

    python bench/carry.py unpack --parts .carry --to .gpu-stack
    PYTHONPATH=.gpu-stack python bench/gpu.py --sf 10 --resident

``pack`` downloads the extra's wheels for the GPU machine's Python and platform (not this
machine's), installs them into a folder as they will be imported there, and writes that
folder as one xz-compressed tar cut into parts, with a manifest of every part's SHA-256 and
the whole's. ``unpack`` checks every part against the manifest (a missing, short or changed
part is named), joins them and extracts the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PART_BYTES = 60 << 20
"""Each part's size: under the 64 MiB a call takes, with room for the manifest."""
MANIFEST = "manifest.json"
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)),
    *("manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"),
)
"""The wheel tags the GPU machine takes (x86_64 Linux, glibc 2.28 or later), newest first:
pip told a ``--platform`` takes that tag alone, not the older ones it implies."""


class CarryError(Exception):
    """A part is missing, short or not the part the manifest names."""


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def pack_tree(tree: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """``tree`` as an xz-compressed tar in parts of at most ``part_bytes`` under ``out``,
    with a manifest; the parts' paths."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        archive = Path(scratch) / "stack.tar.xz"
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            tar.add(tree, arcname=".")
        parts = []
        with archive.open("rb") as whole:
            while chunk := whole.read(part_bytes):
                part = out / f"part-{len(parts):03d}"
                part.write_bytes(chunk)
                parts.append(part)
        manifest = {
            "parts": [
                {"name": p.name, "bytes": p.stat().st_size, "sha256": digest(p)} for p in parts
            ],
            "sha256": digest(archive),
        }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return parts


def unpack(parts: Path, to: Path) -> None:
    """The folder ``pack_tree`` packed, from its parts under ``parts``, into ``to`` (which
    is replaced); nothing is extracted unless every part is the one the manifest names."""
    try:
        manifest = json.loads((parts / MANIFEST).read_text())
    except FileNotFoundError:
        raise CarryError(f"{parts / MANIFEST} is missing: carry it with the parts") from None
    except ValueError as error:
        raise CarryError(f"{parts / MANIFEST} is not the manifest packed: {error}") from None
    problems = []
    for entry in manifest["parts"]:
        part = parts / entry["name"]
        if not part.exists():
            problems.append(f"{entry['name']} is missing")
        elif part.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['name']} has {part.stat().st_size} of {entry['bytes']} bytes")
        elif digest(part) != entry["sha256"]:
            problems.append(f"{entry['name']} is not the part packed (SHA-256 differs)")
    if problems:
        raise CarryError("; ".join(problems))
    with tempfile.TemporaryDirectory(dir=to.parent if to.parent.exists() else None) as scratch:
        archive = Path(scratch) / "stack.tar.xz"
        with archive.open("wb") as whole:
            for entry in manifest["parts"]:
                whole.write((parts / entry["name"]).read_bytes())
        if digest(archive) != manifest["sha256"]:
            raise CarryError("the joined parts are not the archive packed")
        staging = Path(scratch) / "tree"
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(staging, filter="data")
        if to.exists():
            shutil.rmtree(to)
        shutil.move(staging, to)


def extra_pins(extra: str) -> list[str]:
    """The pins of shardflow's optional ``extra`` in pyproject.toml."""
    import tomllib

    project = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(project.read_text())["project"]["optional-dependencies"]
    if extra not in extras:
        raise CarryError(f"shardflow has no extra {extra!r} (it has {', '.join(sorted(extras))})")
    return list(extras[extra])


def install(pins: list[str], python: str, into: Path) -> None:
    """``pins`` and what they need installed into ``into`` as the GPU machine's ``python``
    will import them: wheels for its platform, not this machine's. The folder holds a
    whole, consistent set (numpy and the CUDA libraries too, where the packages need
    them)."""
    pip = [sys.executable, "-m", "pip", "install", "--target", str(into), "--only-binary=:all:"]
    pip += [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    pip += ["--python-version", python, "--quiet"]
    if subprocess.run([*pip, *pins], check=False).returncode != 0:
        raise CarryError(f"pip could not install {' '.join(pins)} (its message is above)")


def leave_out(into: Path, name: str) -> int:
    """Remove the installed distribution ``name`` from ``into`` (the files its RECORD
    lists, and its metadata); the bytes removed. For libraries the GPU machine has already
    (its own CUDA libraries), to carry fewer parts."""
    wanted = re.sub(r"[-_.]+", "_", name).lower()
    infos = [
        info
        for info in into.glob("*.dist-info")
        if re.sub(r"[-_.]+", "_", info.name.split("-", 1)[0]).lower() == wanted
    ]
    if not infos:
        raise CarryError(f"{name} is not among the installed distributions")
    root = into.resolve()
    removed = 0
    for info in infos:
        for line in (info / "RECORD").read_text().splitlines():
            path = (into / line.split(",", 1)[0]).resolve()
            if path.is_file() and root in path.parents and info.resolve() not in path.parents:
                removed += path.stat().st_size
                path.unlink()
                for folder in path.parents:  # the package's folders it leaves empty
                    if folder == root or any(folder.iterdir()):
                        break
                    folder.rmdir()
        shutil.rmtree(info)
    return removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="download, install and cut into parts (here)")
    packing.add_argument("--extra", default="gpu-cu13")
    packing.add_argument("--python", default="3.12", help="the GPU machine's Python")
    packing.add_argument("--out", type=Path, default=Path(".carry"))
    packing.add_argument("--part-mb", type=int, default=PART_BYTES >> 20)
    packing.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NAME",
        help="a distribution the GPU machine has already (e.g. a CUDA library): left out",
    )
    take = commands.add_parser("unpack", help="check, join and extract (on the GPU machine)")
    take.add_argument("--parts", type=Path, default=Path(".carry"))
    take.add_argument("--to", type=Path, default=Path(".gpu-stack"))
    args = parser.parse_args()
    try:
        if args.command == "unpack":
            unpack(args.parts, args.to)
            print(f"unpacked into {args.to}: run with PYTHONPATH={args.to}")
        else:
            pack_extra(args)
    except CarryError as error:
        sys.exit(f"cannot {args.command}: {error}")


def pack_extra(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as staging:
        install(extra_pins(args.extra), args.python, Path(staging))
        for name in args.exclude:
            print(f"left out {name}: {leave_out(Path(staging), name) / 2**20:.0f} MiB")
        parts = pack_tree(Path(staging), args.out, args.part_mb << 20)
    total = sum(p.stat().st_size for p in parts)
    print(f"{len(parts)} parts, {total / 2**20:.0f} MiB in all, under {args.out}")


if __name__ == "__main__":
    main()
