"""When speculation pays: the cost model's decisions, from counts alone (no clock). At large
batches it turns itself off; a request whose drafts keep failing stops proposing, but probes
again later; the output stays the model's own either way."""

from __future__ import annotations

from support.engine_checks import run_to_completion
from support.fake_runner import reference_completion

from minivllm.config import SpeculativeConfig
from minivllm.engine.spec_policy import (
    PROBE_BUDGET,
    PROBE_INTERVAL,
    WINDOW,
    SpeculationPolicy,
    batch_probe_interval,
    break_even_acceptance,
    probe_interval,
)
from minivllm.sampling_params import SamplingParams

VOCAB, ORDER = 16, 1


def policy(**options: object) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculativeConfig(**options))  # type: ignore[arg-type]


def test_the_break_even_acceptance_grows_with_the_batch_towards_one():
    values = [break_even_acceptance(b, 0.1) for b in (1, 4, 16, 64, 1024)]
    assert values == sorted(values) and values[0] < 0.1 and values[-1] > 0.99
    assert break_even_acceptance(8, 0.0) == 0.0  # a free token: every draft pays


def test_at_the_batch_limit_nobody_proposes():
    p = policy(disable_by_batch_size=8, draft_token_cost=0.0)
    assert p.should_propose(0, 7) and not p.should_propose(0, 8) and not p.should_propose(0, 99)
    assert policy(disable_by_batch_size=None, draft_token_cost=0.0).should_propose(0, 10_000)


def test_a_request_below_break_even_stops_and_probes_again():
    p = policy(disable_by_batch_size=None, draft_token_cost=0.1)
    assert p.should_propose(7, 1)  # a new request starts at 1/2: above 0.09
    for _ in range(WINDOW):
        p.observe(7, 4, 0)
    interval = p.probe_interval
    decisions = [p.should_propose(7, 1) for _ in range(2 * interval)]
    # One probe every `probe_interval` decode steps, no proposal between.
    assert [i for i, yes in enumerate(decisions) if yes] == [interval - 1, 2 * interval - 1]
    for _ in range(WINDOW // 2):  # the probes hit: the text started quoting its prompt
        p.observe(7, 4, 4)
    assert p.should_propose(7, 1)
    # The same record that pays alone does not pay in a big batch.
    assert p.acceptance(7) < break_even_acceptance(64, 0.1) and not p.should_propose(7, 64)
    p.forget(7)
    assert p.acceptance(7) == 0.5


def test_the_engine_turns_speculation_off_at_large_batches(make_engine):
    """Drafts appear only in plans made with fewer running sequences than the limit, and the
    outputs are the model's own."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 3,
        "draft_token_cost": 0.0,
    }
    engine = make_engine(vocab_size=VOCAB, order=ORDER, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    seqs = [engine.add_request(p, params) for p in prompts]
    late = SamplingParams(temperature=0.0, max_tokens=40)
    seqs.append(engine.add_request([9, 1], late))  # outlives the others: alone at the end
    drafted_at: set[int] = set()
    finals = {}
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        batch = engine.plan()
        if any(s.spec_token_ids for s in batch.seqs):
            drafted_at.add(running)
        finals.update({o.request_id: o for o in engine.execute_and_commit(batch) if o.finished})
    assert drafted_at and max(drafted_at) < 3
    for seq, prompt in zip(seqs, [*prompts, [9, 1]]):
        want = reference_completion(prompt, seq.sampling_params.max_tokens, VOCAB, ORDER)
        assert finals[str(seq.seq_id)].outputs[0].token_ids == want
    assert run_to_completion(engine) == {}


def test_probes_grow_rare_where_verifying_is_dear():
    """A failed probe of k drafts costs k * c / (1 + c) one-token steps: the interval keeps
    that under PROBE_BUDGET of the steps between probes, and never drops below PROBE_INTERVAL."""
    assert probe_interval(0.0, 4) == PROBE_INTERVAL
    assert probe_interval(0.05, 4) == PROBE_INTERVAL + 2  # 0.19 steps / 0.02
    for cost in (0.05, 0.6, 4.7):
        interval = probe_interval(cost, 4)
        assert 4 * cost / (1 + cost) <= PROBE_BUDGET * interval
    assert probe_interval(4.7, 4) > 100


def test_a_new_request_probes_early_even_when_verifying_is_dear():
    p = policy(disable_by_batch_size=None, draft_token_cost=4.7)  # break-even 0.82 > 1/2
    decisions = [p.should_propose(3, 1) for _ in range(PROBE_INTERVAL)]
    assert decisions == [False] * (PROBE_INTERVAL - 1) + [True]
    p.observe(3, 4, 1)  # the probe mostly failed: the next one waits the long interval
    assert not any(p.should_propose(3, 1) for _ in range(p.probe_interval - 1))
    assert p.should_propose(3, 1)


def test_in_a_batch_every_sequences_probes_stretch_to_cost_what_one_sequences_do():
    """k drafts cost k c / (1 + B c) of a B-sequence step and all B sequences probe: their
    intervals stretch by B (1 + c) / (1 + B c), so together they cost what one sequence's
    probes do alone (at c = 0.39, 16 sequences: 3.1x); nothing stretches at one sequence."""
    assert batch_probe_interval(8, 1, 0.39) == 8
    assert batch_probe_interval(8, 16, 0.39) == 25  # ceil(8 * 16 * 1.39 / 7.24)
    for batch in (2, 4, 16, 64):
        interval = batch_probe_interval(57, batch, 0.39)
        assert batch / interval * 4 * 0.39 / (1 + batch * 0.39) <= 4 * 0.39 / 1.39 / 57
    p = policy(disable_by_batch_size=None, draft_token_cost=0.39)  # break-even 0.86 at 16
    decisions = [p.should_propose(3, 16) for _ in range(25)]
    assert decisions == [False] * 24 + [True]  # a new request's first probe, 25 steps in
