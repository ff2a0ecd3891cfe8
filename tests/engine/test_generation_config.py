"""Reading a model's sampling defaults from its generation_config.json (vLLM's
`--generation-config`): which fields count, HF's max_new_tokens as max_tokens, "vllm" and a
folder path, and clear errors for a missing or bad file. No model needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm.cli import build_parser, engine_options
from minivllm.config import EngineConfig
from minivllm.engine.generation_config import default_sampling_params

QWEN_STYLE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 64,
    "min_p": None,
    "num_beams": 1,
    "transformers_version": "4.45.0",
}


def write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_sampling_fields_only(tmp_path):
    """Token ids, do_sample, num_beams and null values are not sampling defaults; HF's
    max_new_tokens is vLLM's max_tokens."""
    model = write(tmp_path / "model", QWEN_STYLE)
    assert default_sampling_params("auto", model) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }


def test_a_token_ids_only_file_gives_no_defaults(tmp_path):
    """What our GGUF conversion writes (bos/eos/pad ids): vLLM's defaults stay."""
    model = write(tmp_path / "model", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    assert default_sampling_params("auto", model) == {}
    assert default_sampling_params("auto", tmp_path / "no-such-file-here") == {}


def test_vllm_ignores_the_file_and_a_folder_replaces_it(tmp_path):
    model = write(tmp_path / "model", QWEN_STYLE)
    other = write(tmp_path / "other", {"temperature": 0.3, "min_p": 0.1})
    assert default_sampling_params("vllm", model) == {}
    assert default_sampling_params(str(other), model) == {"temperature": 0.3, "min_p": 0.1}


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "not a folder holding a generation_config.json"),
        ("{not json", "cannot read"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({"temperature": -1}), "temperature"),
        (json.dumps({"top_k": 20.5}), "top_k"),
        (json.dumps({"max_new_tokens": 0}), "max_tokens"),
    ],
)
def test_a_bad_folder_or_file_is_a_clear_error(tmp_path, content, match):
    folder = tmp_path / "gen"
    folder.mkdir()
    if content is not None:
        (folder / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        default_sampling_params(str(folder), tmp_path)


def test_the_cli_flag_and_the_option():
    args = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert engine_options(args)["generation_config"] == "vllm"
    assert EngineConfig().generation_config == "auto"
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="")
