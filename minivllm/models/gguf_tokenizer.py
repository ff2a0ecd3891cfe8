"""A GGUF's tokenizer, rebuilt from its metadata (`tokenizer.ggml.*`) by transformers' GGUF
tokenizer conversion, once, at the first start that meets the file (`gguf.gguf_model_dir`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minivllm.models.gguf_arch import build_config
from minivllm.models.gguf_file import GGUFFile


def build_tokenizer(gguf_path: Path, model_type: str | None = None) -> Any:
    """The fast tokenizer the GGUF metadata describes (`tokenizer.ggml.*`).

    transformers' GGUF tokenizer conversion builds it offline (`local_files_only`); it carries
    the chat template, the special tokens and `add_bos_token`. `model_type` (the config's,
    `build_config`; read from the file when not given) names the tokenizer class as
    `AutoTokenizer` would pick it: left to itself, `AutoTokenizer` parses every metadata value
    with the `gguf` package's reader just to learn the model type (Gemma 3's 262k-token
    vocabulary: 14 of the 17 s the build took).
    """
    from transformers import AutoTokenizer

    if model_type is None:
        model_type = build_config(GGUFFile(gguf_path)).model_type

    where = {"gguf_file": gguf_path.name, "local_files_only": True}
    # tokenizer files beside the GGUF may name another class: AutoTokenizer reads them
    beside = (gguf_path.parent / "tokenizer_config.json").exists()
    tokenizer_class = None if beside else _tokenizer_class(model_type)
    if tokenizer_class is None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **where)
    else:
        tokenizer = tokenizer_class.from_pretrained(str(gguf_path.parent), _from_auto=True, **where)
    # Loading options, not tokenizer properties; keep them out of tokenizer_config.json.
    for key in ("local_files_only", "is_local", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def _tokenizer_class(model_type: str | None) -> Any:
    """The class `AutoTokenizer` gives a GGUF of this model type and no tokenizer files: the
    one its table names, else `TokenizersBackend` (a type the table lacks, as `llama`); None
    where `AutoTokenizer` itself must decide (no type; Mistral's backend, which it may refuse;
    a name it cannot import). tests/models/test_gguf_tokenizer.py holds both ways equal."""
    if model_type is None:
        return None
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    if model_type not in TOKENIZER_MAPPING_NAMES:
        return TokenizersBackend
    name = TOKENIZER_MAPPING_NAMES[model_type]
    if name is None or name.removesuffix("Fast") == "MistralCommonBackend":
        return None
    return tokenizer_class_from_name(name)
