"""`load_tokenizer`'s snapshot: a tokenizer minivllm converted itself (a GGUF's, in its cache)
is kept pickled for the next start and loaded from it, the same tokenizer; a change to its
files or a torn snapshot loads from the sources again; a user's directory is never written."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from minivllm import tokenizer as tokenizer_module

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
    first = tokenizer_module.load_tokenizer(converted)
    (snapshot,) = converted.glob("tokenizer-snapshot-*.pickle")
    sources = tokenizer_module._from_sources

    def refuse(model_dir: Path) -> None:
        raise AssertionError("loaded from the sources, not the snapshot")

    monkeypatch.setattr(tokenizer_module, "_from_sources", refuse)
    again = tokenizer_module.load_tokenizer(converted)
    assert type(again) is type(first)
    assert again.encode(TEXT) == first.encode(TEXT)
    assert again.decode(first.encode(TEXT)) == first.decode(first.encode(TEXT))
    assert again.eos_token_id == first.eos_token_id

    monkeypatch.setattr(tokenizer_module, "_from_sources", sources)
    snapshot.write_bytes(b"torn")  # a broken snapshot: the sources, then a good one again
    assert tokenizer_module.load_tokenizer(converted).encode(TEXT) == first.encode(TEXT)
    assert snapshot.read_bytes() != b"torn"

    tokenizer_json = converted / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text() + "\n")  # a changed source file
    tokenizer_module.load_tokenizer(converted)
    (fresh,) = converted.glob("tokenizer-snapshot-*.pickle")
    assert fresh != snapshot and not snapshot.exists()


def test_a_users_directory_is_only_read(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    users = _copy_tokenizer(tiny_llama_dir, tmp_path / "my-model")
    before = sorted(p.name for p in users.iterdir())
    assert tokenizer_module.load_tokenizer(users).encode(TEXT)
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

    monkeypatch.setattr(tokenizer_module.pickle, "dumps", refuse)
    assert tokenizer_module.load_tokenizer(converted).encode(TEXT)
    assert not list(converted.glob("tokenizer-snapshot-*"))


def test_a_snapshot_loads_without_torch(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's HTTP process loads the tokenizer and has no other use for torch: from a
    snapshot, neither `minivllm.tokenizer` nor the unpickled tokenizer imports it."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    converted = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-89ab")
    tokenizer_module.load_tokenizer(converted)  # writes the snapshot
    code = (
        "import sys; from pathlib import Path; from minivllm.tokenizer import load_tokenizer; "
        f"t = load_tokenizer(Path({str(converted)!r})); assert t.encode({TEXT!r}); "
        "print('torch' in sys.modules)"
    )
    env = {**os.environ, "MINIVLLM_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_construction_copies_are_dropped_and_nothing_else(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BPE class that keeps its vocabulary and merges as Python objects beside the Rust
    tokenizer (Qwen2's here, on the tiny vocabulary) loads without them, from the sources and
    from the snapshot, and tokenizes as transformers' own load does."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    converted = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-cdef")
    settings = json.loads((converted / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "Qwen2Tokenizer"
    (converted / "tokenizer_config.json").write_text(json.dumps(settings))
    reference = AutoTokenizer.from_pretrained(converted)
    assert reference._merges  # the copies this test is about
    messages = [{"role": "user", "content": TEXT}]
    for _ in range(2):  # from the sources, then from the snapshot
        loaded = tokenizer_module.load_tokenizer(converted)
        assert type(loaded) is type(reference)
        assert loaded.encode(TEXT) == reference.encode(TEXT)
        ids = reference.encode(TEXT)
        assert loaded.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
        assert loaded.get_vocab() == reference.get_vocab()
        assert loaded.apply_chat_template(messages, tokenize=False) == (
            reference.apply_chat_template(messages, tokenize=False)
        )
        assert not loaded.__dict__.get("_merges") and not loaded.__dict__.get("_vocab")
        assert len(pickle.dumps(loaded)) < len(pickle.dumps(reference))


def test_the_decoding_tokenizer_decodes_as_the_whole_one(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine process's tokenizer (`load_decoder`): a BPE copy without its merges, kept
    in a snapshot of its own, decodes every id sequence as the whole tokenizer does without
    loading it; asked to encode, it loads the whole one and encodes as it does; grammars
    (llguidance) get the whole one."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    converted = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-d0d0")
    whole = tokenizer_module.load_tokenizer(converted)
    for _ in range(2):  # built from the whole tokenizer, then from its own snapshot
        decoding = tokenizer_module.load_decoder(converted)
        assert isinstance(decoding, tokenizer_module.DecodingTokenizer)
        assert not decoding._decoder._tokenizer.to_str().count('"merges":[["')
        rng = random.Random(0)
        sequences = [whole.encode(TEXT)] + [
            [rng.randrange(len(whole)) for _ in range(rng.randint(1, 12))] for _ in range(300)
        ]
        for ids in sequences:
            for skip in (False, True):
                assert decoding.decode(ids, skip_special_tokens=skip) == whole.decode(
                    ids, skip_special_tokens=skip
                )
            assert decoding.convert_ids_to_tokens(ids) == whole.convert_ids_to_tokens(ids)
        assert decoding.eos_token_id == whole.eos_token_id and len(decoding) == len(whole)
        assert decoding._full is None  # decoding never loaded the whole tokenizer
    assert len(list(converted.glob("tokenizer-snapshot-decoder-*.pickle"))) == 1
    assert decoding.encode(TEXT) == whole.encode(TEXT)  # loads the whole one
    assert tokenizer_module.whole_tokenizer(decoding) is decoding.full
    assert tokenizer_module.whole_tokenizer(whole) is whole

    users = _copy_tokenizer(tiny_llama_dir, tmp_path / "my-model")
    assert type(tokenizer_module.load_decoder(users)) is type(whole)  # only read: whole
    read_only = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-d2d2")
    tokenizer_module.load_tokenizer(read_only)
    monkeypatch.setattr(tokenizer_module.os, "access", lambda path, mode: False)
    assert type(tokenizer_module.load_decoder(read_only)) is type(whole)  # no snapshot: whole
    assert not list(read_only.glob("tokenizer-snapshot-decoder-*"))


def test_grammars_read_the_whole_tokenizer(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A structured output's forced text tokenizes through the merges: with the decoding
    tokenizer its matcher forces the same tokens as with the whole one."""
    from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
    from minivllm.structured.matcher import StructuredOutputs

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    converted = _copy_tokenizer(tiny_llama_dir, tmp_path / "cache" / "gguf" / "m-d1d1")
    whole = tokenizer_module.load_tokenizer(converted)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="The quick brown"))
    forced = []
    for tokenizer in (whole, tokenizer_module.load_decoder(converted)):
        structured = StructuredOutputs(tokenizer, len(whole), (whole.eos_token_id,))
        matcher = structured.matcher_for(params)
        forced.append(matcher._matcher.compute_ff_tokens())
    assert forced[0] == forced[1] == whole.encode("The quick brown")
