"""LoRA adapters against PEFT: three adapters and the base model in one batch, each
token-exact (fp32 greedy) with PEFT's merged model; the prefix cache never crosses adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.lora_adapters import ADAPTERS, make_peft_adapter, merged_greedy

from minivllm import LoRARequest, SamplingParams

PROMPT = [1, 17, 42, 99, 7, 3, 250, 64, 12, 5, 77, 31, 8, 90, 45, 61, 22, 13]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    return [
        LoRARequest(name, i, str(make_peft_adapter(tiny_llama_dir, root / name, i, **cfg)))
        for i, (name, cfg) in enumerate(ADAPTERS, start=1)
    ]


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir: Path):
    from minivllm import LLM

    return LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128, enable_lora=True
    )


def test_three_adapters_and_base_in_one_batch_match_peft_merged(
    lora_llm, adapters: list[LoRARequest], tiny_llama_dir: Path
) -> None:
    """Each row of a mixed batch runs its own adapter (or none): the masked per-row update,
    the fused q/k/v and gate/up placement and rsLoRA scaling are exact against PEFT."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [None, *adapters]
    outs = lora_llm.generate([PROMPT] * 4, params, use_tqdm=False, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    want = [
        merged_greedy(tiny_llama_dir, None if r is None else Path(r.lora_path), PROMPT, MAX_TOKENS)
        for r in loras
    ]
    assert got == want
    assert len({tuple(g) for g in got}) == 4, "the adapters must change the output"
