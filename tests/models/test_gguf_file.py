"""The GGUF header parser: what gguf-py's reader sees, and one clear line naming the file for
every kind of bad file (truncated anywhere, not a GGUF, unknown version, type or
architecture), also from every command (exit status 2, no traceback, nothing cached); tensor
types without a kernel loaded dequantized, with one warning."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from support.gguf_files import write_tiny_llama_gguf

from minivllm.cli import main
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
    writer.add_tensor(
        "b.weight", rng.integers(0, 256, (8, 2 * 34), dtype=np.uint8), raw_dtype=QT.Q8_0
    )
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
        np.testing.assert_array_equal(
            np.asarray(mine.data).reshape(-1).view(np.uint8),
            np.asarray(ref.data).reshape(-1).view(np.uint8),
        )


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


def test_a_vocabulary_is_skipped_and_a_cut_one_is_named(tmp_path: Path) -> None:
    """An array of more strings than the header keeps (a vocabulary) is skipped to the tensor
    table; cut anywhere inside, or its lengths running past the end, the file fails with one
    line naming the array."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = [f"tok{i}" * (1 + i % 3) for i in range(5000)]
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_tensor("a.weight", np.ones((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed = GGUFFile(path)
    assert parsed.metadata["tokenizer.ggml.tokens"] is None
    assert [t.name for t in parsed.tensors] == ["a.weight"]
    raw = path.read_bytes()
    start = raw.index(b"tok0")
    inflated = bytearray(raw)  # the last token's length claims more than the file holds
    last = raw.index(tokens[-1].encode(), start) - 8
    inflated[last : last + 8] = struct.pack("<Q", len(raw))
    for data in (raw[: start + 9000], raw[: start + 3], bytes(inflated)):
        with pytest.raises(GGUFFileError, match="'tokenizer.ggml.tokens' runs past the end"):
            GGUFFile(_bad(tmp_path, data))


def test_unknown_tensor_type_is_named(good: Path, tmp_path: Path) -> None:
    raw = bytearray(good.read_bytes())
    # the type id of the first tensor follows its name and shape in the table
    name = b"a.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8
    raw[at : at + 4] = struct.pack("<I", 250)
    with pytest.raises(GGUFFileError, match="'a.weight' has unknown ggml type id 250"):
        GGUFFile(_bad(tmp_path, bytes(raw)))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """kind -> (a bad file, what its one line must say), from a loadable tiny llama GGUF."""
    out = tmp_path_factory.mktemp("bad")
    raw = write_tiny_llama_gguf(out / "tiny.gguf").read_bytes()
    table = raw.index(b"blk.0.ffn_up.weight") + len(b"blk.0.ffn_up.weight")

    def patched(at: int, value: bytes) -> bytes:
        return raw[:at] + value + raw[at + len(value) :]

    files = {
        "truncated": (raw[:-100], "'blk.1.ffn_down.weight' needs 65536 bytes"),
        "header": (raw[:table], "the file is truncated"),
        "not gguf": (b"PK\x03\x04" + raw[4:], "not a GGUF file"),
        "unknown type": (
            patched(table + 4 + 2 * 8, struct.pack("<I", 250)),
            "'blk.0.ffn_up.weight' has unknown ggml type id 250",
        ),
        "empty dimension": (
            patched(table + 4, struct.pack("<Q", 0)),
            "'blk.0.ffn_up.weight' has shape [0, 256], with an empty dimension",
        ),
    }
    paths = {}
    for kind, (data, expected) in files.items():
        path = out / f"{kind.replace(' ', '-')}.gguf"
        path.write_bytes(data)
        paths[kind] = (path, expected)
    paths["architecture"] = (
        write_tiny_llama_gguf(out / "mamba.gguf", arch="mamba"),
        "GGUF architecture 'mamba' is not supported",
    )
    paths["unreadable type"] = (
        write_tiny_llama_gguf(out / "q8k.gguf", ffn_type=QT.Q8_K),
        "'blk.0.ffn_down.weight' has type Q8_K, which minivllm cannot read",
    )
    return paths


BAD_KINDS = [
    "truncated",
    "header",
    "not gguf",
    "unknown type",
    "empty dimension",
    "architecture",
    "unreadable type",
]


def _assert_one_line(stderr: str, path: Path, expected: str, cache: Path) -> None:
    lines = [line for line in stderr.strip().splitlines() if line]
    assert lines[-1].startswith("minivllm: error: ") and str(path) in lines[-1], stderr
    assert expected in lines[-1], stderr
    assert "Traceback" not in stderr
    assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_cli_refuses_each_bad_file_in_one_line(
    bad_files: dict[str, tuple[Path, str]],
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`minivllm generate --model BAD.gguf`: exit status 2, one line naming the file, the
    tensor and what is wrong, and nothing written to the cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINIVLLM_CACHE", str(cache))
    path, expected = bad_files[kind]
    assert main(["generate", "hi", "--model", str(path)]) == 2
    _assert_one_line(capsys.readouterr().err, path, expected, cache)


@pytest.mark.parametrize(
    "command,kind",
    [
        (["generate", "hi"], "truncated"),
        (["serve", "--port", "0"], "architecture"),  # the engine in its own process
        (["bench", "throughput"], "unknown type"),
    ],
)
def test_every_command_exits_2_without_traceback(
    bad_files: dict[str, tuple[Path, str]],
    command: list[str],
    kind: str,
    tmp_path: Path,
) -> None:
    """The same through the installed command, as a user runs it: generate, serve (whose
    engine process reports the error back) and bench."""
    cache = tmp_path / "cache"
    path, expected = bad_files[kind]
    env = dict(os.environ, MINIVLLM_CACHE=str(cache))
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm.cli", *command, "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    _assert_one_line(proc.stderr, path, expected, cache)


def test_types_without_a_kernel_load_dequantized_with_one_warning(
    bad_files: dict[str, tuple[Path, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An IQ4_NL tensor (no kernel of ours runs it) is decoded at load into the dense weight
    gguf-py's dequantization gives, and one warning names the type and what it costs."""
    from minivllm import LLM, SamplingParams
    from minivllm.layers.cpu_kernels import cpu_kernels_available
    from minivllm.models.gguf import dequantize_tensor

    cpu_kernels_available()  # built once in the usual cache, not again in this test's
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(tmp_path / "iq4nl.gguf", ffn_type=QT.IQ4_NL)
    with caplog.at_level(logging.WARNING, logger="minivllm.models.gguf"):
        llm = LLM(model=str(path), dtype="float32", enforce_eager=True, device="cpu")
    warnings = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert warnings == [
        "iq4nl.gguf: 2 tensors of type IQ4_NL have no kernel here: dequantized "
        "at load into dense float32 weights, 0.1 MB in memory against 0.0 MB "
        "as stored (slower loads and steps)"
    ]
    weight = llm.llm_engine.model_runner.model.model.layers[0].mlp.down_proj.weight
    expected = dequantize_tensor(GGUFFile(path).by_name["blk.0.ffn_down.weight"])
    np.testing.assert_array_equal(weight.numpy(), expected)
    out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
