"""Speculative decoding on the fake runner: the n-gram proposer, the plan that schedules
1 + k tokens, the commit that keeps accepted + 1, and every stop rule and resource guarantee
of plain decoding, unchanged.

The fake model here looks only at the last token or two (`order`), over a small vocabulary,
so its output soon cycles and prompt lookup proposes tokens it accepts; greedy acceptance is
then checked against the tokens the same model gives without speculation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.engine_checks import run_to_completion
from support.fake_runner import FakeModelRunner, reference_completion

from minivllm.cli import build_parser, engine_options
from minivllm.config import EngineConfig, SpeculativeConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import SequenceStatus
from minivllm.engine.spec_decode import (
    NgramProposer,
    SpecDecodeStats,
    mean_acceptance_length,
    per_position,
    propose_ngram,
)
from minivllm.sampling_params import SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
VOCAB, ORDER = 16, 1


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_completion(prompt, max_tokens, VOCAB, ORDER)


# ---- the proposer -----------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # "2 3" occurs at 1 and 5; the latest is followed by 7 8 5.
    assert propose_ngram(tokens, 1, 2, 3) == [7, 8, 5]
    # A 3-gram "5 2 3" never occurred before: down to n = 2.
    assert propose_ngram(tokens, 2, 3, 2) == [7, 8]
    assert propose_ngram(np.array([4, 5, 6, 7]), 1, 3, 3) == []  # nothing repeats
    # The match's continuation may be shorter than k (it runs into the suffix itself).
    assert propose_ngram(np.array([1, 2, 1, 2]), 2, 2, 5) == [1, 2]


def test_proposer_respects_its_room_and_its_minimum():
    proposer = NgramProposer(SpeculativeConfig(**NGRAM))
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert proposer.propose(tokens, 10) == [3, 4, 1]  # k = 3
    assert proposer.propose(tokens, 1) == [3]
    assert proposer.propose(tokens, 0) == []
    assert NgramProposer(SpeculativeConfig(prompt_lookup_min=3)).propose([1, 2, 3], 4) == []


# ---- configuration ---------------------------------------------------------------------


def test_speculative_config_accepts_vllms_shapes():
    config = EngineConfig(speculative_config=NGRAM)
    assert config.speculative_config == SpeculativeConfig(**NGRAM)
    assert EngineConfig(speculative_config=json.dumps(NGRAM)) == config
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", json.dumps(NGRAM)])
    assert EngineConfig(**engine_options(args)) == config
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
        ({"model": "", "num_speculative_tokens": 3}, 'needs "model"'),
        ({"method": "ngram", "model": "d.gguf"}, 'is for method "draft_model"'),
        ({"model": "d.gguf", "draft_kv_blocks": 8}, "unknown speculative_config key"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not supported"),
        ({"num_speculative_tokens": 3}, 'needs a "method"'),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"method": "ngram", "lookahead": 2}, "unknown speculative_config key"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "positive integer or null"),
        ({"method": "ngram", "draft_token_cost": -1}, "a number >= 0"),
        ({"method": "ngram", "draft_token_cost": "cheap"}, "a number >= 0"),
        ("{not json", "not valid JSON"),
        (7, "must be a dict"),
        ({"method": "none", "num_speculative_tokens": 3}, "takes no other keys"),
    ],
)
def test_bad_speculative_configs_say_what_to_change(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=bad)


def test_method_none_is_the_off_switch_in_python_json_and_the_cli():
    """`{"method": "none"}` means no speculation (None) in every way the option is given, and
    stays allowed where speculation is refused (tensor parallelism)."""
    off = {"method": "none"}
    assert EngineConfig(speculative_config=off).speculative_config is None
    assert EngineConfig(speculative_config=json.dumps(off)).speculative_config is None
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", json.dumps(off)])
    assert EngineConfig(**engine_options(args)).speculative_config is None
    assert EngineConfig(speculative_config=off, tensor_parallel_size=2).speculative_config is None
    for command in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*command, "--no-speculation"])
        assert EngineConfig(**engine_options(args)).speculative_config is None


def test_no_speculation_and_a_speculative_config_together_are_refused(capsys):
    """The off switch and a config contradict each other: argparse refuses the pair (exit 2)
    instead of letting whichever came last win silently."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(
            ["generate", "hi", "--no-speculation", "--speculative-config", json.dumps(NGRAM)]
        )
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_speculation_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="not supported yet"):
        EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)


# ---- plan, execute, commit ---------------------------------------------------------------


def spec_engine(make_engine, **options):
    options.setdefault("speculative_config", NGRAM)
    return make_engine(vocab_size=VOCAB, order=ORDER, **options)


def test_the_plan_schedules_drafts_and_the_commit_keeps_accepted_plus_one(make_engine):
    """The chapter's rule at its sharpest: after the plan scheduled = 1 + k; after execute
    k + 1 slots hold KV; the commit advances cached by accepted + 1 only."""
    engine = spec_engine(make_engine)
    prompt = [1, 2, 3, 4]
    seq = engine.add_request(prompt, greedy(max_tokens=40))
    saw_rejection = saw_acceptance = False
    while not seq.is_finished:
        batch = engine.plan()
        drafts = list(seq.spec_token_ids)
        cached, tokens = seq.num_cached_tokens, seq.num_tokens
        if drafts:
            assert seq.num_scheduled_tokens == 1 + len(drafts)
            assert seq.num_cached_tokens == seq.num_tokens - 1  # a decode, not a prefill
            assert len(seq.block_table) * 4 >= cached + 1 + len(drafts)  # blocks for all
        engine.execute_and_commit(batch)
        if drafts and not seq.is_finished:
            grown = seq.num_tokens - tokens
            assert seq.num_cached_tokens == cached + grown  # accepted + 1
            assert seq.spec_token_ids == [] and seq.num_scheduled_tokens == 0
            assert seq.token_ids[tokens : tokens + grown - 1] == drafts[: grown - 1]
            saw_acceptance |= grown > 1
            saw_rejection |= grown < 1 + len(drafts)
        engine.scheduler.check_invariants()
    assert seq.completion_token_ids == reference(prompt, 40)
    assert saw_acceptance and saw_rejection
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_drafts"] > 0
    # Position j counts the steps whose draft j was accepted: one per position up to accepted.
    counts = per_position(stats)
    assert len(counts) == NGRAM["num_speculative_tokens"]
    assert sum(counts) == stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_num_drafts"] >= counts[0] >= counts[1] >= counts[2] > 0


def test_per_position_counts_and_mean_acceptance_length():
    stats = SpecDecodeStats(3)
    for drafts, accepted in [(3, 3), (3, 1), (2, 0), (3, 2)]:
        stats.observe(drafts, accepted)
    assert stats.accepted_per_pos == [3, 2, 1]
    out = stats.as_stats()
    assert per_position(out) == [3, 2, 1]
    assert (
        out["spec_decode_num_drafts"],
        out["spec_decode_num_draft_tokens"],
        out["spec_decode_num_accepted_tokens"],
    ) == (4, 11, 6)
    assert mean_acceptance_length(4, 6) == 2.5
    assert mean_acceptance_length(0, 0) is None


def test_greedy_output_is_the_same_with_and_without_speculation(make_engine):
    """A mixed batch (prefills, decodes, speculating or not) under a small token budget gives
    every request the tokens the model gives it alone."""
    engine = spec_engine(make_engine, max_num_batched_tokens=7)
    prompts = [[1, 2, 3], [5, 5, 5, 5, 5, 5, 5, 5, 5], [7, 1], list(range(16)) * 2]
    seqs = [engine.add_request(p, greedy(max_tokens=30)) for p in prompts]
    finals = run_to_completion(engine)
    for seq, prompt in zip(seqs, prompts):
        assert finals[str(seq.seq_id)].outputs[0].token_ids == reference(prompt, 30)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_preemption_mid_speculation_keeps_the_tokens(make_engine):
    engine = spec_engine(make_engine, num_blocks=14)
    prompts = [[i, i + 1, i + 2] for i in range(5)]
    seqs = [engine.add_request(p, greedy(max_tokens=20)) for p in prompts]
    finals = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert finals[str(seq.seq_id)].outputs[0].token_ids == reference(prompt, 20)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_is_exact(make_engine, max_tokens):
    engine = spec_engine(make_engine)
    seq = engine.add_request([3, 1, 4], greedy(max_tokens=max_tokens))
    out = run_to_completion(engine)[str(seq.seq_id)].outputs[0]
    assert out.token_ids == reference([3, 1, 4], max_tokens)
    assert out.finish_reason == "length"


def test_eos_inside_an_accepted_run_ends_the_output_there(make_engine):
    """Every token of the completion as EOS in turn: the output stops at its first
    occurrence (the drafts after it dropped), exactly as without speculation. The prompt
    holds the answer (its own chain, then its first token again), so drafts run ahead of
    the first EOS."""
    prompt = [2, *reference([2], 10), 2]
    full = reference(prompt, 30)
    inside = 0
    for eos in sorted(set(full)):
        engine = spec_engine(make_engine, eos_token_ids=(eos,))
        seq = engine.add_request(prompt, greedy(max_tokens=30))
        out = run_to_completion(engine)[str(seq.seq_id)].outputs[0]
        assert out.token_ids == full[: full.index(eos) + 1]
        assert out.finish_reason == "stop"
        stats = engine.stats()
        # The accepted drafts outnumber the tokens kept after the first: some were dropped.
        inside += stats["spec_decode_num_accepted_tokens"] > len(out.token_ids) - 1 - (
            stats["spec_decode_num_drafts"] == 0
        )
    assert inside > 0


def test_min_tokens_and_stop_token_ids_hold_under_speculation(make_engine):
    """The same outputs as without speculation, for an EOS that min_tokens holds off and a
    stop token."""
    prompt = [2, *reference([2], 10), 2]
    full = reference(prompt, 30)
    requests = [
        greedy(max_tokens=30, min_tokens=8),
        greedy(max_tokens=30, stop_token_ids=[full[5]], ignore_eos=True),
    ]
    results = []
    for spec in [None, NGRAM]:
        engine = make_engine(
            vocab_size=VOCAB, order=ORDER, eos_token_ids=(full[3],), speculative_config=spec
        )
        seqs = [engine.add_request(prompt, params) for params in requests]
        finals = run_to_completion(engine)
        results.append(
            [
                (
                    finals[str(s.seq_id)].outputs[0].token_ids,
                    finals[str(s.seq_id)].outputs[0].finish_reason,
                )
                for s in seqs
            ]
        )
        assert (engine.stats()["spec_decode_num_accepted_tokens"] > 0) == (spec is not None)
    assert results[0] == results[1]
    assert len(results[1][0][0]) >= 8 and results[1][1][0][-1] == full[5]


class LetterTokenizer:
    """Token i is the letter 'a' + i: stop strings without a real tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize("at", [2, 5, 9, 13])
def test_a_stop_string_inside_an_accepted_run_cuts_tokens_and_text(at):
    prompt = [2, *reference([2], 10), 2]
    full = reference(prompt, 30)
    text = LetterTokenizer().decode(full)
    stop = text[at : at + 2]
    end = text.index(stop)
    config = EngineConfig(block_size=4, max_model_len=128, speculative_config=NGRAM)
    engine = LLMEngine(config, FakeModelRunner(64, 4, VOCAB, ORDER), LetterTokenizer())
    seq = engine.add_request(prompt, greedy(max_tokens=30, stop=[stop]))
    out = run_to_completion(engine)[str(seq.seq_id)].outputs[0]
    assert out.text == text[:end]
    assert out.token_ids == full[: end + 2]  # up to the token that completed the stop string
    assert out.finish_reason == "stop"


def test_abort_of_a_planned_speculative_step_frees_everything(make_engine):
    engine = spec_engine(make_engine)
    seq = engine.add_request([1, 2, 3], greedy(max_tokens=30))
    other = engine.add_request([4, 5], greedy(max_tokens=30))
    while not seq.spec_token_ids:
        batch = engine.plan()
        if seq.spec_token_ids:
            break
        engine.execute_and_commit(batch)
    assert engine.abort_request(seq.seq_id)
    assert seq.spec_token_ids == [] and seq.block_table == [] and seq.status.name == "FINISHED"
    engine.execute_and_commit(batch)
    finals = run_to_completion(engine)
    assert finals[str(other.seq_id)].outputs[0].token_ids == reference([4, 5], 30)


def test_a_failed_speculative_step_commits_nothing(make_engine):
    engine = spec_engine(make_engine)
    seq = engine.add_request([1, 2, 3], greedy(max_tokens=30))
    while True:
        batch = engine.plan()
        if seq.spec_token_ids:
            break
        engine.execute_and_commit(batch)
    cached, tokens = seq.num_cached_tokens, list(seq.token_ids)
    engine.model_runner.fail_on_calls = {engine.model_runner.calls + 1}
    outs = engine.execute_and_commit(batch)
    assert seq.num_cached_tokens == cached and seq.token_ids == tokens
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == "error"
    assert seq.spec_token_ids == [] and outs[0].error


def test_requests_with_logprobs_speculate_but_a_token_budget_of_one_does_not(make_engine):
    engine = spec_engine(make_engine)
    seq = engine.add_request([1, 2, 3], greedy(max_tokens=30, logprobs=1))
    finals = run_to_completion(engine)
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert finals[str(seq.seq_id)].outputs[0].token_ids == reference([1, 2, 3], 30)
    engine = spec_engine(make_engine, max_num_batched_tokens=1)
    seq = engine.add_request([1, 2, 3], greedy(max_tokens=30))
    finals = run_to_completion(engine)
    assert engine.stats()["spec_decode_num_drafts"] == 0
    assert finals[str(seq.seq_id)].outputs[0].token_ids == reference([1, 2, 3], 30)
