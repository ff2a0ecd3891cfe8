"""The default model with the default options (on a CPU with native bf16: bf16 compute and
the GGUF's 4-bit weights packed int4) against HF transformers fp32 on the same GGUF: the
quality bar (perplexity at most +0.5%, top-1 >= 97%), on the engine's prefill and
decode-sized paths alike."""

from __future__ import annotations

import pytest
from support.prompts import MIXED_PROMPTS

from minivllm import SamplingParams
from minivllm.bench.quality import measure_quality

pytestmark = pytest.mark.default_model


def test_defaults_stay_within_half_a_percent_perplexity_and_97_percent_top1(default_llm):
    """Perplexity within +0.5% of HF fp32's and teacher-forced top-1 agreement >= 97% on the
    fixed English text, scored as one prefill and in steps of 4 tokens (the int4 kernels)."""
    report = measure_quality(default_llm, decode_chunk=4, max_tokens=320)
    for path in ("prefill", "decode"):
        r = report[path]
        assert r["perplexity_delta_pct"] <= 0.5, (path, r)
        assert r["top1_agreement_pct"] >= 97.0, (path, r)


def test_defaults_keep_greedy_within_the_top5_rule(default_llm, default_llm_fp32):
    """At the first token where the defaults and fp32 greedy differ, each one's token is in
    the other's top-5 (vLLM's rule for lower-precision kernels)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    exact = default_llm_fp32.generate(MIXED_PROMPTS, params, use_tqdm=False)
    fast = default_llm.generate(MIXED_PROMPTS, params, use_tqdm=False)
    for a, b in zip(exact, fast, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        i = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if i is not None:
            assert tb[i] in a.outputs[0].logprobs[i] and ta[i] in b.outputs[0].logprobs[i], i
