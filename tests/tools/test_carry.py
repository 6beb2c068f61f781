"""``bench/carry.py``: a folder cut into parts of a fixed size with a manifest, joined and
extracted again only when every part is the one packed (the GPU stack's way to a machine
that takes files in parts of at most 64 MiB)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "carry.py"


@pytest.fixture(scope="module")
def carry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carry", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def packed(tmp_path: Path, carry: ModuleType) -> tuple[Path, Path]:
    stack = tmp_path / "stack"
    (stack / "pkg" / "lib").mkdir(parents=True)
    (stack / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (stack / "pkg" / "lib" / "blob.so").write_bytes(os.urandom(300_000))  # incompressible
    out = tmp_path / "parts"
    parts = carry.pack_tree(stack, out, part_bytes=100_000)
    assert len(parts) >= 3 and all(p.stat().st_size <= 100_000 for p in parts)
    return stack, out


def test_a_packed_folder_comes_back_whole(
    packed: tuple[Path, Path], tmp_path: Path, carry: ModuleType
) -> None:
    stack, parts = packed
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "stale.txt").write_text("from an earlier unpack")
    carry.unpack(parts, tmp_path / "there")
    assert tree(tmp_path / "there") == tree(stack)


@pytest.mark.parametrize("damage", ["missing", "short", "changed"])
def test_a_missing_short_or_changed_part_is_named_and_nothing_extracted(
    packed: tuple[Path, Path], tmp_path: Path, carry: ModuleType, damage: str
) -> None:
    _, parts = packed
    part = parts / "part-001"
    if damage == "missing":
        part.unlink()
    elif damage == "short":
        part.write_bytes(part.read_bytes()[:-10])
    else:
        data = bytearray(part.read_bytes())
        data[5] ^= 0xFF
        part.write_bytes(bytes(data))
    with pytest.raises(carry.CarryError, match="part-001"):
        carry.unpack(parts, tmp_path / "there")
    assert not (tmp_path / "there").exists()


def test_a_distribution_left_out_takes_its_files_and_nothing_else(
    tmp_path: Path, carry: ModuleType
) -> None:
    """What pip installed for ``nvidia-cublas`` goes (files its RECORD lists, its folders
    left empty, its metadata); another distribution's files and anything outside the
    folder stay, whatever the RECORD says."""
    into = tmp_path / "site"
    outside = tmp_path / "outside.txt"
    outside.write_text("not the stack's")
    for name, files in (("nvidia_cublas-13.1", ["nvidia/cu13/lib/libcublas.so"]),
                        ("numpy-2.5", ["numpy/__init__.py"])):  # fmt: skip
        info = into / f"{name}.dist-info"
        info.mkdir(parents=True)
        for relative in files:
            (into / relative).parent.mkdir(parents=True, exist_ok=True)
            (into / relative).write_bytes(b"x" * 1000)
        record = [*files, "../outside.txt", f"{name}.dist-info/RECORD"]
        (info / "RECORD").write_text("".join(f"{r},sha256=,\n" for r in record))
    assert carry.leave_out(into, "nvidia-cublas") == 1000
    assert tree(into) == {
        "numpy-2.5.dist-info/RECORD": (into / "numpy-2.5.dist-info/RECORD").read_bytes(),
        "numpy/__init__.py": b"x" * 1000,
    }
    assert not (into / "nvidia").exists() and outside.exists()
    with pytest.raises(carry.CarryError, match="not among"):
        carry.leave_out(into, "nvidia-cublas")


def test_parts_without_their_manifest_are_refused_saying_so(
    packed: tuple[Path, Path], tmp_path: Path, carry: ModuleType
) -> None:
    _, parts = packed
    (parts / "manifest.json").unlink()
    with pytest.raises(carry.CarryError, match=r"manifest\.json is missing"):
        carry.unpack(parts, tmp_path / "there")
    assert not (tmp_path / "there").exists()
