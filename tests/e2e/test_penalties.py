"""Penalties, logit bias and min_tokens: the sampler against plain-Python references, HF's
repetition penalty, and the engine end to end on the tiny checkpoints.

The end-to-end reference is a greedy loop over the HF model that recomputes the whole sequence
each step and applies the penalties token by token in Python: nothing of the engine's paging,
batching or vectorised penalties is shared with it.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_reference import hf_model, reference_greedy, reference_penalties

from minivllm import LLM, SamplingParams
from minivllm.layers.sampler import Sampler, SamplingBatch, apply_penalties

VOCAB = 50
PROMPTS = [[5, 17, 42, 99, 3, 5, 5], [7] * 9, list(range(10, 30)), [200, 201, 3, 200]]
MAX_TOKENS = 16


def test_apply_penalties_matches_the_rules_row_by_row():
    gen = torch.Generator().manual_seed(0)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    histories = [
        torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in [1, 5, 9, 30, 2, 12]
    ]
    num_prompt = [1, 2, 9, 10, 2, 0]  # row 2: prompt only; row 5: no prompt tokens at all
    repetition = [1.0, 1.3, 0.7, 2.0, 1.0, 1.1]
    presence = [0.0, 0.5, -0.5, 1.0, 2.0, 0.0]
    frequency = [0.0, 0.25, 0.0, -1.0, 0.0, 1.5]
    got = apply_penalties(
        logits, histories, num_prompt, *(torch.tensor(v) for v in [repetition, presence, frequency])
    )
    for row in range(rows):
        want = reference_penalties(
            logits[row],
            histories[row],
            num_prompt[row],
            repetition[row],
            presence[row],
            frequency[row],
        )
        torch.testing.assert_close(got[row], want)


def _batch(params: list[SamplingParams], histories: list[list[int]], num_prompt: list[int]):
    return SamplingBatch(params, [len(h) for h in histories], histories, num_prompt)


def test_logit_bias_and_min_tokens_change_the_choice_but_not_the_logprobs():
    logits = torch.zeros(3, VOCAB)
    logits[:, 4] = 5.0  # every row's argmax, and the EOS id below
    sampler = Sampler(0, torch.device("cpu"), eos_token_ids=(4,))
    params = [
        SamplingParams(temperature=0, logit_bias={9: 10.0}, logprobs=1),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7], logprobs=1),
        SamplingParams(temperature=0, min_tokens=1, logprobs=1),  # already has 1 completion token
    ]
    out = sampler(logits, _batch(params, [[1, 2], [1, 2, 3], [1, 2, 3]], [2, 2, 2]))
    assert out.token_ids[0] == 9  # 0 + 10 beats 5
    assert out.token_ids[1] not in (4, 7)  # EOS and the stop token are banned before 3 tokens
    assert out.token_ids[2] == 4  # min_tokens reached: EOS is allowed again
    raw = logits.log_softmax(-1)
    chosen = [entry[token].logprob for entry, token in zip(out.logprobs, out.token_ids)]
    assert chosen == pytest.approx(
        [raw[0, 9].item(), raw[1, out.token_ids[1]].item(), raw[2, 4].item()]
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={3: 101.0}), "logit_bias values"),
        (dict(logit_bias={"3": 1.0}), "logit_bias keys"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_invalid_penalties_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


# ---- end to end ---------------------------------------------------------------------------


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


MIXED = [
    greedy(),
    greedy(repetition_penalty=1.5),
    greedy(presence_penalty=1.5, frequency_penalty=0.5),
    greedy(frequency_penalty=2.0, repetition_penalty=0.8, logit_bias={11: 3.0, 12: -2.0}),
]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize(
    "options", [dict(), dict(block_size=4, num_kv_blocks=12)], ids=["default", "preempts"]
)
def test_penalised_greedy_matches_the_reference_in_one_mixed_batch(model, options, request):
    """Every row of one batch gets its own penalties (the plain row is unchanged), whatever the
    scheduling: the small pool preempts and recomputes, and the penalties still count the
    completion generated before the preemption."""
    model_dir = str(request.getfixturevalue(model))
    llm = LLM(model_dir, dtype="float32", **options)  # the reference is fp32
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(MIXED))]
    outs = llm.generate(prompts, MIXED, use_tqdm=False)
    if options:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    got = [o.outputs[0].token_ids for o in outs]
    want = [reference_greedy(model_dir, p, sp) for p, sp in zip(prompts, MIXED, strict=True)]
    assert got == want
    assert got[0] != got[2], "the penalties changed nothing: the test would not see them"


def test_repetition_penalty_matches_hf_generate(tiny_llama_dir):
    model = hf_model(str(tiny_llama_dir))
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    for prompt in PROMPTS:
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        [out] = llm.generate([prompt], greedy(repetition_penalty=1.3), use_tqdm=False)
        assert out.outputs[0].token_ids == hf


def test_min_tokens_bans_eos_until_reached(tiny_llama_dir):
    """EOS pushed to the top by a bias: it cannot come before min_tokens, then ends the request
    at once; without min_tokens it is the first token."""
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    eos = llm.llm_engine.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
    [out] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop"
    assert len(tokens) == 6 and eos not in tokens[:5] and tokens[5] == eos
    plain = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
    [out] = llm.generate([PROMPTS[0]], plain, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos]


def test_logit_bias_outside_the_vocabulary_is_rejected_at_add(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    with pytest.raises(ValueError, match="logit_bias token id .* outside the vocabulary"):
        llm.llm_engine.add_request(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
    assert not llm.llm_engine.has_unfinished_requests()
