"""The cost model's figure measured at start-up: the formula, and the timing recipe on a fake
runner whose steps advance a fake clock (no real time is measured)."""

from __future__ import annotations

import pytest

from minivllm.config import EngineConfig
from minivllm.engine import spec_cost
from minivllm.engine.runner_output import RunnerOutput, SampledToken
from minivllm.engine.spec_cost import (
    MAX_COST,
    MIN_BATCH_SPEEDUP,
    MIN_BEST_SPEEDUP,
    StepTimes,
    batch_limit,
    best_speedup,
    draft_token_cost,
    measure_step_times,
    token_cost,
    with_default_speculation,
    with_measured_draft_cost,
)


@pytest.mark.parametrize("c", [0.0, 0.05, 0.6, 2.0])
def test_the_formula_inverts_the_linear_step_model(c: float):
    k = 4
    ratio = (1 + c * (1 + k)) / (1 + c)
    assert draft_token_cost(ratio, k) == pytest.approx(c)


def test_the_formula_clamps_at_both_ends():
    assert draft_token_cost(0.9, 4) == 0.0  # a verification step faster than a plain one
    assert draft_token_cost(5.0, 4) == MAX_COST  # a token costs a whole step
    assert draft_token_cost(7.0, 4) == MAX_COST


class FakeRunner:
    """Each step takes `fixed + per_token * N` seconds on the fake clock for its N tokens, and
    `past_knee` more a token beyond `knee` (a step bound by its multiply-adds past a few rows);
    records each sequence's plan as (step, cached, scheduled, block table)."""

    def __init__(
        self,
        clock: list[float],
        fixed: float,
        per_token: float,
        blocks: int = 64,
        knee: int = 1 << 30,
        past_knee: float = 0.0,
    ):
        self.clock, self.fixed, self.per_token = clock, fixed, per_token
        self.knee, self.past_knee = knee, past_knee
        self.num_kv_blocks = blocks
        self.steps = 0
        self.plans: list[tuple[int, int, int, list[int]]] = []

    def run(self, batch, token_bitmask=None) -> RunnerOutput:
        tokens = sum(seq.num_scheduled_tokens for seq in batch.seqs)
        for seq in batch.seqs:
            plan = (self.steps, seq.num_cached_tokens, seq.num_scheduled_tokens, seq.block_table)
            self.plans.append(plan)
        self.steps += 1
        extra = self.past_knee * max(0, tokens - self.knee)
        self.clock[0] += self.fixed + self.per_token * tokens + extra
        return RunnerOutput(samples=[SampledToken(0, None, 0, None) for _ in batch.seqs])


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(spec_cost.time, "perf_counter", lambda: now[0])
    return now


def test_measuring_a_runner_recovers_its_per_token_cost(clock):
    runner = FakeRunner(clock, fixed=0.010, per_token=0.006)  # c = 0.6
    assert token_cost(measure_step_times(runner, 4, 16), 4) == pytest.approx(0.6)
    # plain steps run 1 token, verification steps 1 + k, after CONTEXT cached tokens, in the
    # pool's first blocks
    assert {n for _, _, n, _ in runner.plans} == {1, 5}
    assert all(cached == spec_cost.CONTEXT for _, cached, _, _ in runner.plans)
    assert all(table == list(range(len(table))) for _, _, _, table in runner.plans)


def test_speculation_kept_on_times_a_third_step_of_two_sequences(clock):
    runner = FakeRunner(clock, fixed=0.010, per_token=0.001)  # c = 0.1: drafts stay on
    with_measured_draft_cost(EngineConfig(speculative_config={"method": "ngram"}), runner)
    by_step: dict[int, list[tuple[int, int, list[int]]]] = {}
    for step, cached, scheduled, table in runner.plans:
        by_step.setdefault(step, []).append((cached, scheduled, table))
    shapes = {tuple(n for _, n, _ in seqs) for seqs in by_step.values()}
    assert shapes == {(1,), (5,), (5, 5)}
    assert all(cached == spec_cost.CONTEXT for _, cached, _, _ in runner.plans)
    for seqs in by_step.values():
        blocks = [b for _, _, table in seqs for b in table]
        assert blocks == list(range(len(blocks)))  # the first blocks, no two sequences sharing


def test_a_draft_model_adds_its_own_step_per_draft_token(clock):
    target = FakeRunner(clock, fixed=0.010, per_token=0.0)  # c = 0 on its own
    draft = FakeRunner(clock, fixed=0.002, per_token=0.0)
    assert token_cost(measure_step_times(target, 4, 16, draft), 4) == pytest.approx(0.2)


def test_too_small_a_pool_is_not_measured(clock):
    assert measure_step_times(FakeRunner(clock, 0.01, 0.0, blocks=2), 4, 16) is None


def test_the_config_keeps_a_cost_the_user_gave_and_fills_an_unset_one(clock):
    runner = FakeRunner(clock, fixed=0.010, per_token=0.006)
    given = EngineConfig(speculative_config={"method": "ngram", "draft_token_cost": 0.3})
    assert with_measured_draft_cost(given, runner) is given
    assert runner.plans == []
    unset = EngineConfig(speculative_config={"method": "ngram"})
    measured = with_measured_draft_cost(unset, runner)
    assert measured.speculative_config.draft_token_cost == pytest.approx(0.6)
    plain = EngineConfig()
    assert with_measured_draft_cost(plain, runner) is plain


def test_best_speedup_is_all_drafts_accepted_under_the_step_model():
    assert best_speedup(0.0, 4) == pytest.approx(5.0)
    assert best_speedup(1.4, 4) == pytest.approx(5 * 2.4 / 8.0)
    assert best_speedup(MAX_COST, 4) < 1.05


def test_speculation_is_left_off_where_even_full_acceptance_cannot_pay(clock, caplog):
    dear = FakeRunner(clock, fixed=0.010, per_token=0.040)  # a 5-token step: 4.2 steps
    config = with_measured_draft_cost(EngineConfig(speculative_config={"method": "ngram"}), dear)
    spec = config.speculative_config
    assert best_speedup(spec.draft_token_cost, 4) < MIN_BEST_SPEEDUP
    assert spec.disable_by_batch_size == 1  # the batch rule: nobody speculates
    assert "speculative decoding off" in caplog.text
    assert {n for _, _, n, _ in dear.plans} == {1, 5}  # no third step: it would decide nothing
    free = FakeRunner(clock, fixed=0.010, per_token=0.0)  # tokens cost nothing: any batch pays
    config = with_measured_draft_cost(EngineConfig(speculative_config={"method": "ngram"}), free)
    assert config.speculative_config.disable_by_batch_size == 256


def test_unset_speculation_defaults_to_ngram_on_the_cpu_where_drafts_pay(clock, caplog):
    """The default: n-gram with vLLM's keys, its cost measured like a user's config."""
    cheap = FakeRunner(clock, fixed=0.010, per_token=0.001)
    with caplog.at_level("INFO"):
        config = with_default_speculation(EngineConfig(), cheap, "cpu", chosen=False)
    spec = config.speculative_config
    assert spec.method == "ngram" and spec.num_speculative_tokens == 4
    assert spec.draft_token_cost == pytest.approx(0.1)
    # the linear model's own batch limit: full acceptance wins 1.25x up to B = 30
    assert spec.disable_by_batch_size in (30, 31)
    assert "on by default" in caplog.text


def test_the_default_is_dropped_where_full_acceptance_cannot_pay(clock, caplog):
    """Unlike a user's config (kept, switched off by the batch rule, with a warning), the
    default leaves the engine without speculation, and says so at info level."""
    dear = FakeRunner(clock, fixed=0.010, per_token=0.040)
    with caplog.at_level("INFO"):
        config = with_default_speculation(EngineConfig(), dear, "cpu", chosen=False)
    assert config.speculative_config is None
    assert "off by default" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    tiny_pool = FakeRunner(clock, fixed=0.010, per_token=0.001, blocks=2)
    config = with_default_speculation(EngineConfig(), tiny_pool, "cpu", chosen=False)
    assert config.speculative_config is None


@pytest.mark.parametrize(
    ("options", "device"),
    [
        ({"speculative_config": {"method": "none"}}, "cpu"),  # the off switch
        ({}, "cuda"),
        ({"enable_lora": True}, "cpu"),
    ],
)
def test_no_default_speculation_off_the_cpu_with_lora_or_the_off_switch(clock, options, device):
    runner = FakeRunner(clock, fixed=0.010, per_token=0.001)
    config = EngineConfig(**options)
    chosen = "speculative_config" in options
    assert with_default_speculation(config, runner, device, chosen).speculative_config is None
    assert runner.plans == []  # nothing measured either


def test_a_chosen_config_is_measured_as_given_not_replaced(clock):
    runner = FakeRunner(clock, fixed=0.010, per_token=0.001)
    mine = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    spec = with_default_speculation(mine, runner, "cpu", chosen=True).speculative_config
    assert spec.num_speculative_tokens == 2 and spec.draft_token_cost is not None


def test_the_step_model_is_linear_through_the_measured_steps_and_on_past_them():
    times = StepTimes(plain=0.010, verify=0.014, wide=0.034)
    assert times.at(1, 4) == pytest.approx(0.010)
    assert times.at(3, 4) == pytest.approx(0.012)
    assert times.at(10, 4) == pytest.approx(0.034)
    assert times.at(15, 4) == pytest.approx(0.054)  # the second slope, 4 ms a token
    assert StepTimes(0.010, 0.014).at(15, 4) == pytest.approx(0.024)  # no wide step: the first


@pytest.mark.parametrize(("fixed", "per_token"), [(0.010, 0.0013), (0.020, 0.0007), (0.01, 0.004)])
def test_the_batch_limit_is_where_full_acceptance_stops_winning_the_margin(fixed, per_token):
    k = 4
    times = StepTimes(*(fixed + per_token * n for n in (1, 1 + k, 2 * (1 + k))))
    limit = batch_limit(times, k)

    def best(batch: int) -> float:  # B sequences, all k drafts accepted, over B plain ones
        return (1 + k) * (fixed + per_token * batch) / (fixed + per_token * batch * (1 + k))

    assert best(limit) < MIN_BATCH_SPEEDUP <= best(limit - 1)
    assert batch_limit(StepTimes(0.010, 0.010, 0.010), k) is None  # free tokens: no limit


def test_a_step_bound_by_its_multiply_adds_past_a_few_rows_stops_speculation_at_a_small_batch(
    clock, caplog
):
    """One sequence's 5 tokens cost little more than 1 (c = 0.1), but past 5 tokens a token
    costs 4x as much: the linear model would let 16 sequences speculate; the wide step stops
    them at 3."""
    runner = FakeRunner(clock, fixed=0.010, per_token=0.001, knee=5, past_knee=0.003)
    spec = with_measured_draft_cost(EngineConfig(speculative_config={"method": "ngram"}), runner)
    spec = spec.speculative_config
    assert spec.draft_token_cost == pytest.approx(0.1)
    assert batch_limit(StepTimes(0.011, 0.015, 0.020), 4) >= 30  # the linear model alone
    assert spec.disable_by_batch_size == 3
    # a smaller batch limit the user gave stays; where the pool cannot hold two sequences'
    # verifying steps, the first slope goes on (the linear model's limit, B = 30)
    mine = {"method": "ngram", "disable_by_batch_size": 2}
    spec = with_measured_draft_cost(EngineConfig(speculative_config=mine), runner)
    assert spec.speculative_config.disable_by_batch_size == 2
    small = FakeRunner(clock, 0.010, 0.001, blocks=3, knee=5, past_knee=0.003)
    spec = with_measured_draft_cost(EngineConfig(speculative_config={"method": "ngram"}), small)
    assert spec.speculative_config.disable_by_batch_size in (30, 31)
