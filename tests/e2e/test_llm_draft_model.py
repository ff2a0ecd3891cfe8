"""Speculative decoding with a draft model on tiny random checkpoints: the draft runs on a
ModelRunner and KV pool of its own, and the output is the target's.

Greedy on the fp32 path is token-identical to decoding without speculation, with the target
as its own draft (nearly every draft accepted) and with another checkpoint of the same
vocabulary (few accepted), in mixed batches, chunked prefill and under preemption. Sampled:
the distribution of the tokens after a draft equals the one without speculation. Bad drafts
are refused at load with a message naming the draft, on the CLI too.
"""

from __future__ import annotations

import functools
import json

import pytest
from support.spec_checks import OFF, second_tokens, total_variation

from minivllm import LLM, SamplingParams
from minivllm.cli import main
from minivllm.sampling_params import StructuredOutputsParams

PROMPTS = [
    [5, 17, 42, 99, 3] * 4,
    [200, 201, 202, 203, 204, 205, 206, 207, 1, 2, 3] * 2 + [200, 201],
    list(range(10, 60)),
    [7] * 9,
]
SMALL = {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 30}


def spec(draft: str | None) -> dict:
    """The cost model off, so every decoding sequence drafts at every step; without a draft,
    no speculation at all (the baseline)."""
    if draft is None:
        return OFF
    return {
        "model": draft,
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
        "draft_token_cost": 0.0,
    }


@functools.cache
def cached_llm(model_dir: str, draft: str | None, small: bool = False, seed: int = 0) -> LLM:
    options = SMALL if small else {}
    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=256,
        speculative_config=spec(draft),
        seed=seed,
        **options,
    )


def spec_delta(llm: LLM, run) -> tuple[object, dict]:
    before = llm.llm_engine.stats()
    result = run()
    after = llm.llm_engine.stats()
    return result, {k: after[k] - before[k] for k in after if k.startswith("spec_decode_num")}


def assert_draft_pool_free(llm: LLM) -> None:
    proposer = llm.llm_engine.scheduler.proposer
    assert proposer.shadows == {}
    bm = proposer.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    target = llm.llm_engine.scheduler.block_manager
    assert target.num_free_blocks == target.num_blocks


@pytest.mark.parametrize("small", [False, True], ids=["default", "chunked-preempting"])
@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_with_a_draft_model_is_token_identical(
    tiny_llama_dir, tiny_llama3_rope_dir, draft, small
):
    """A mixed batch of four (small: 16-token budget, 4-token blocks and a 30-block pool, so
    prefills are chunked and sequences preempted): the tokens without speculation."""
    target = str(tiny_llama_dir)
    draft_dir = target if draft == "self" else str(tiny_llama3_rope_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = cached_llm(target, None, small)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    llm = cached_llm(target, draft_dir, small)
    outputs, delta = spec_delta(llm, lambda: llm.generate(PROMPTS, params, use_tqdm=False))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    rate = delta["spec_decode_num_accepted_tokens"] / delta["spec_decode_num_draft_tokens"]
    assert delta["spec_decode_num_drafts"] >= 4 * 5
    if draft == "self":
        assert rate > 0.9, delta
    else:
        assert rate < 0.5, delta
    if small:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_draft_pool_free(llm)


def test_aborted_requests_give_their_draft_blocks_back(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), str(tiny_llama_dir))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    while not engine.scheduler.proposer.shadows:
        engine.step()
    for _ in range(2):
        engine.step()
    assert engine.scheduler.proposer.block_manager.num_free_blocks < (
        engine.scheduler.proposer.block_manager.num_blocks
    )
    for seq in seqs:
        engine.abort_request(seq.seq_id)
    assert_draft_pool_free(llm)


def test_sampled_speculation_with_a_draft_model_keeps_the_targets_distribution(tiny_llama_dir):
    """Every second token is drafted, the target's own greedy choice: accepted with the
    target's probability of it, else resampled without it."""
    prompt = [5, 17, 42, 99, 3, 8, 8, 1]
    n = 400
    plain = second_tokens(cached_llm(str(tiny_llama_dir), None, seed=1), prompt, n)
    llm = cached_llm(str(tiny_llama_dir), str(tiny_llama_dir), seed=1)
    spec_counts, delta = spec_delta(llm, lambda: second_tokens(llm, prompt, n))
    assert delta["spec_decode_num_draft_tokens"] >= n
    assert 0 < delta["spec_decode_num_accepted_tokens"] < delta["spec_decode_num_draft_tokens"]
    # Two samples of 400 from one distribution over a few pairs: TV about 0.06.
    assert total_variation(plain, spec_counts) < 0.15, (plain, spec_counts)


def test_bad_drafts_are_refused_with_the_drafts_name(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="draft model .*does not exist"):
        LLM(str(tiny_llama_dir), speculative_config={"model": str(tmp_path / "missing")})
    other_vocab = tmp_path / "other_vocab"
    other_vocab.mkdir()
    for item in tiny_llama_dir.iterdir():
        (other_vocab / item.name).write_bytes(item.read_bytes())
    config = json.loads((other_vocab / "config.json").read_text())
    config["vocab_size"] = 500
    (other_vocab / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of 500 tokens, the target 384"):
        LLM(str(tiny_llama_dir), speculative_config={"model": str(other_vocab)})


def test_the_cli_refuses_a_bad_draft_in_one_line(tiny_llama_dir, tmp_path, capsys):
    for bad in [{"model": str(tmp_path / "missing")}, {"model": "d", "lookahead": 2}]:
        argv = ["generate", "hi", "--model", str(tiny_llama_dir), "--max-tokens", "2"]
        assert main([*argv, "--speculative-config", json.dumps(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("minivllm: error: ") and "\n" not in err, err
        assert "speculative_config" in err


def test_structured_outputs_and_logprobs_with_a_draft_model_are_the_same(tiny_llama_dir):
    """Logprobs come from the verifying rows; the grammar cuts the draft model's drafts as it
    cuts n-gram ones (the draft proposes unconstrained, so a constrained request keeps few)."""
    target = str(tiny_llama_dir)
    tokenizer = cached_llm(target, None).get_tokenizer()
    prompts = [PROMPTS[0]] + [
        tokenizer.encode(t, add_special_tokens=False) for t in ["ab ab ab", "x <1><2>"]
    ]
    grammars = [None, r"(ab ){2,20}", r"(<[0-9]+>)+"]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            logprobs=2,
            structured_outputs=None if g is None else StructuredOutputsParams(regex=g),
        )
        for g in grammars
    ]
    plain = cached_llm(target, None).generate(prompts, params, use_tqdm=False)
    llm = cached_llm(target, target)
    spec_out, delta = spec_delta(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
    assert delta["spec_decode_num_accepted_tokens"] > 0, delta
    for p, s in zip(plain, spec_out):
        p, s = p.outputs[0], s.outputs[0]
        assert (s.token_ids, s.text, s.finish_reason) == (p.token_ids, p.text, p.finish_reason)
        assert [sorted(e) for e in s.logprobs] == [sorted(e) for e in p.logprobs]
    assert_draft_pool_free(llm)
