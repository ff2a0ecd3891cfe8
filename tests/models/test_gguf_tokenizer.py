"""A GGUF's tokenizer, built with the class named from our own config, equals AutoTokenizer's
own pick (which reads the whole file with the `gguf` package first to learn the model type)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from support.gguf_files import write_tiny_llama_gguf

import minivllm.models.gguf_tokenizer as mgguf


def _saved(tokenizer: Any, out: Path) -> dict[str, str]:
    tokenizer.save_pretrained(out)
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())}


def _auto(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    for key in ("local_files_only", "is_local", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_named_class_saves_what_auto_tokenizer_saves(tmp_path: Path, arch: str) -> None:
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", arch=arch)
    ours = mgguf.build_tokenizer(path)
    reference = _auto(path)
    assert type(ours) is type(reference)
    assert _saved(ours, tmp_path / "ours") == _saved(reference, tmp_path / "reference")
    assert ours("hello world").input_ids == reference("hello world").input_ids


def test_the_class_each_model_type_takes() -> None:
    from transformers import TokenizersBackend

    assert mgguf._tokenizer_class("gemma3_text").__name__ == "GemmaTokenizer"
    assert mgguf._tokenizer_class("qwen2").__name__ == "Qwen2Tokenizer"
    assert mgguf._tokenizer_class("llama") is TokenizersBackend  # not in transformers' table
    assert mgguf._tokenizer_class(None) is None


def test_tokenizer_files_beside_the_gguf_leave_the_choice_to_auto_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_llama_gguf(tmp_path / "m.gguf")
    (tmp_path / "tokenizer_config.json").write_text("{}")

    def named(model_type: str | None) -> Any:
        raise AssertionError("the class was named despite tokenizer files beside the GGUF")

    monkeypatch.setattr(mgguf, "_tokenizer_class", named)
    assert mgguf.build_tokenizer(path)("hello").input_ids
