"""The GGUF header parser: what gguf-py's reader sees, and one clear line naming the file for
every kind of bad file (truncated anywhere, not a GGUF, unknown version or type), also from
the command line (exit status 2, no traceback)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minivllm.models.gguf_file import GGUFFile, GGUFFileError


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_array("some.floats", [1.5, 2.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((4, 64)).astype(np.float32))
    writer.add_tensor("b.weight", rng.integers(0, 256, (8, 2 * 34), dtype=np.uint8),
                      raw_dtype=QT.Q8_0)
    writer.add_tensor("c.weight", rng.standard_normal(32).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reads_what_gguf_py_reads(good: Path) -> None:
    """Metadata, tensor names, types, shapes and bytes equal gguf-py's GGUFReader's."""
    ours, theirs = GGUFFile(good), gguf.GGUFReader(str(good))
    assert ours.metadata["general.name"] == "tiny"
    assert ours.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    assert ours.metadata["some.floats"] == [1.5, 2.5]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type
        assert mine.shape == tuple(int(d) for d in ref.shape)
        np.testing.assert_array_equal(np.asarray(mine.data).reshape(-1).view(np.uint8),
                                      np.asarray(ref.data).reshape(-1).view(np.uint8))


def _bad(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    return path


def test_bad_files_fail_with_one_line_naming_the_file(good: Path, tmp_path: Path) -> None:
    raw = good.read_bytes()
    header_end = len(raw) - GGUFFile(good).n_bytes - 64  # somewhere in the tensor table
    cases = {
        "too short for a GGUF header": raw[:10],
        "not a GGUF file": b"PK\x03\x04" + raw[4:],
        "version 9 is not supported": raw[:4] + struct.pack("<I", 9) + raw[8:],
        "the file is truncated": raw[:header_end],
        "bytes missing: the file is truncated": raw[:-8],
    }
    for expected, data in cases.items():
        path = _bad(tmp_path, data)
        with pytest.raises(GGUFFileError) as info:
            GGUFFile(path)
        message = str(info.value)
        assert expected in message and str(path) in message and "\n" not in message, message


def test_unknown_tensor_type_is_named(good: Path, tmp_path: Path) -> None:
    raw = bytearray(good.read_bytes())
    # the type id of the first tensor follows its name and shape in the table
    name = b"a.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8
    raw[at : at + 4] = struct.pack("<I", 250)
    with pytest.raises(GGUFFileError, match="'a.weight' has unknown ggml type id 250"):
        GGUFFile(_bad(tmp_path, bytes(raw)))


def test_cli_says_one_line_and_exits_2(good: Path, tmp_path: Path) -> None:
    path = _bad(tmp_path, good.read_bytes()[:-8])
    proc = subprocess.run([sys.executable, "-m", "minivllm.cli", "generate", "hi", "--model",
                           str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("minivllm: error: ") and str(path) in lines[-1]
    assert "Traceback" not in proc.stderr
