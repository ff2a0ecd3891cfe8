"""`load_tokenizer`'s snapshot: a tokenizer minivllm converted itself (a GGUF's, in its cache)
is kept pickled for the next start and loaded from it, the same tokenizer; a change to its
files or a torn snapshot loads from the sources again; a user's directory is never written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from minivllm.models import config as model_config

TEXT = "The quick brown fox, 12 x 7 = 84.\n<|im_start|>user"


def _copy_tokenizer(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "config")):
            shutil.copy(path, target / path.name)
    return target


def test_a_converted_tokenizer_comes_back_from_its_snapshot(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    converted = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-0123")
    first = model_config.load_tokenizer(converted)
    (snapshot,) = converted.glob("tokenizer-snapshot-*.pickle")
    sources = model_config.AutoTokenizer

    class Refuse:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("loaded from the sources, not the snapshot")

    monkeypatch.setattr(model_config, "AutoTokenizer", Refuse)
    again = model_config.load_tokenizer(converted)
    assert type(again) is type(first)
    assert again.encode(TEXT) == first.encode(TEXT)
    assert again.decode(first.encode(TEXT)) == first.decode(first.encode(TEXT))
    assert again.eos_token_id == first.eos_token_id

    monkeypatch.setattr(model_config, "AutoTokenizer", sources)
    snapshot.write_bytes(b"torn")  # a broken snapshot: the sources, then a good one again
    assert model_config.load_tokenizer(converted).encode(TEXT) == first.encode(TEXT)
    assert snapshot.read_bytes() != b"torn"

    tokenizer_json = converted / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text() + "\n")  # a changed source file
    model_config.load_tokenizer(converted)
    (fresh,) = converted.glob("tokenizer-snapshot-*.pickle")
    assert fresh != snapshot and not snapshot.exists()


def test_a_users_directory_is_only_read(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    users = _copy_tokenizer(tiny_llama_dir, tmp_path / "my-model")
    before = sorted(p.name for p in users.iterdir())
    assert model_config.load_tokenizer(users).encode(TEXT)
    assert sorted(p.name for p in users.iterdir()) == before


def test_a_tokenizer_that_cannot_be_kept_still_loads(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pickling fails (a tokenizer class that refuses it, or a read-only cache): the tokenizer
    is still returned, and no partial file is left."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    converted = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-4567")

    def refuse(*args, **kwargs):
        raise TypeError("cannot pickle this tokenizer")

    monkeypatch.setattr(model_config.pickle, "dumps", refuse)
    assert model_config.load_tokenizer(converted).encode(TEXT)
    assert not list(converted.glob("tokenizer-snapshot-*"))
