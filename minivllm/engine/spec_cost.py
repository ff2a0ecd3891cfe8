"""The cost model's one figure, `draft_token_cost`, measured on the loaded model at start-up.

The policy (`spec_policy.py`) models a step's time as t(N) = t0 * (1 + c * N) for N tokens.
What c is depends on the model and the machine far more than on anything else: a small model
is bound by per-step overheads, so a 5-token verification step costs little more than a
1-token one (c near 0.05), while a 1B-class model on a CPU computes every token's products
and a 5-token step costs several 1-token steps (c above 1). A constant fits one of them only.

So the engine times the two steps the policy weighs, on the real runner, before it serves:
a 1-token decode step and a verification step of 1 + k tokens, each for one sequence after
`CONTEXT` tokens, best of `ROUNDS`; with a draft model, its one-token step too, which each
draft token costs on top. With r = t(1 + k) / t(1), the model gives

    r = (1 + c * (1 + k)) / (1 + c)   =>   c = (r - 1) / (1 + k - r)

Their KV goes to the pool's first blocks, which no request holds yet. Torch-free: it only
calls the runner and reads the clock.

The linear model holds where a step is bound by reading the weights; where a batch's tokens
are bound by the multiply-adds (an AVX2 CPU, a 262k-row LM head), a token costs more past a few
rows than the 1 -> 1 + k slope says, and at 16 sequences fully accepted drafts lost to plain
decoding (docs/benchmarks.md, "Zen 3"). So a third step, two sequences verifying k drafts each
(2 (1 + k) tokens), times the slope there, and `batch_limit` turns the two slopes into the batch
size from which even fully accepted drafts would win less than `MIN_BATCH_SPEEDUP`: the batch
rule's `disable_by_batch_size` becomes at most that.

The same measurement decides the default (`with_default_speculation`): on the CPU, an engine
whose user left `speculative_config` unset gets n-gram speculation (vLLM's keys, k = 4), kept
only where fully accepted drafts would win `MIN_BEST_SPEEDUP`. A 1.5B model on a 2-core CPU
reads its weights once for 1 or 5 tokens alike, so drafts pay there; the 135M default model's
5-token step costs more than two 1-token ones, so it decodes without (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from minivllm.config import EngineConfig, SpeculativeConfig
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.step_times_store import load_step_times, save_step_times, step_times_key
from minivllm.paging import blocks_for
from minivllm.sampling_params import SamplingParams
from minivllm.startup import phase

logger = logging.getLogger(__name__)

CONTEXT = 32  # tokens already cached before the timed steps
ROUNDS = 5
MAX_COST = 100.0  # r at or past 1 + k: a token costs a step, so drafts never pay
# Below this best case (every draft accepted) speculation is left off: what it could win is
# within what the cost model misses (probes, partial acceptance, larger batches); with a best
# case below it, open chat lost and quoting answers barely won (docs/benchmarks.md,
# "Speculative decoding on chat workloads").
MIN_BEST_SPEEDUP = 2.0
# ... and at a batch: below this best case the drafts' win is within what the step model leaves
# out there (the proposer, the verification's sampling, sequences at other lengths)
MIN_BATCH_SPEEDUP = 1.25
# A start whose one-token step is this much faster than the kept one's times every step again
QUIETER = 0.9
WIDE_ROUNDS = 1  # the third step costs several one-token steps: one timed run after its warm-up


@dataclass(frozen=True)
class StepTimes:
    """Seconds of a step of 1 and of 1 + k tokens (one sequence) and of 2 (1 + k) (two
    sequences; `wide`, None where the pool cannot hold them); `draft`, with a draft model, its
    one-token step."""

    plain: float
    verify: float
    wide: float | None = None
    draft: float = 0.0

    def at(self, tokens: float, k: int) -> float:
        """A step of `tokens` tokens: linear through the measured points, on past the last."""
        if tokens <= 1 + k or self.wide is None:
            return self.plain + (self.verify - self.plain) * (tokens - 1) / k
        return self.verify + (self.wide - self.verify) * (tokens - 1 - k) / (1 + k)


def best_speedup(token_cost: float, num_speculative_tokens: int) -> float:
    """Tokens per second of a sequence whose k drafts are all accepted, over plain decoding:
    1 + k tokens in a step that costs (1 + c (1 + k)) / (1 + c) one-token steps."""
    k, c = num_speculative_tokens, token_cost
    return (1 + k) * (1 + c) / (1 + c * (1 + k))


def draft_token_cost(ratio: float, num_speculative_tokens: int) -> float:
    """c from r = t(1 + k) / t(1) (the module's formula), clamped to [0, MAX_COST]."""
    k = num_speculative_tokens
    if ratio <= 1.0:
        return 0.0
    if ratio >= 1 + k:
        return MAX_COST
    return min(MAX_COST, (ratio - 1.0) / (1 + k - ratio))


def batch_limit(times: StepTimes, k: int, largest: int = 256) -> int | None:
    """The smallest batch B (from 2) at which B sequences whose k drafts are all accepted would
    decode less than MIN_BATCH_SPEEDUP times faster than B plain ones, by `times`: (1 + k) t(B)
    against t(B (1 + k)) plus k draft-model steps; None if no B up to `largest`."""
    for batch in range(2, largest + 1):
        plain = times.at(batch, k)
        drafted = times.at(batch * (1 + k), k) + k * times.draft
        if (1 + k) * plain < MIN_BATCH_SPEEDUP * drafted:
            return batch
    return None


def _plan(num_drafts: int, block_size: int, num_seqs: int = 1) -> ScheduledBatch:
    """`num_seqs` sequences with CONTEXT cached tokens each running its last token and
    `num_drafts` drafts (0: a plain decode step), in the pool's first blocks."""
    per_seq = blocks_for(CONTEXT + 1 + num_drafts, block_size)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(-1 - i, [0] * (CONTEXT + 1), SamplingParams(temperature=0.0, max_tokens=16))
        seq.status = SequenceStatus.RUNNING
        seq.num_cached_tokens = CONTEXT
        seq.spec_token_ids = [0] * num_drafts
        seq.num_scheduled_tokens = 1 + num_drafts
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(seq)
    return ScheduledBatch(seqs)


def _step_seconds(
    runner: Any, num_drafts: int, block_size: int, num_seqs: int = 1, rounds: int = ROUNDS
) -> float:
    best = float("inf")
    for _ in range(rounds + 1):  # the first run warms up this step's shape
        plan = _plan(num_drafts, block_size, num_seqs)
        start = time.perf_counter()
        runner.run(plan)
        best = min(best, time.perf_counter() - start)
    return best


def measure_step_times(
    runner: Any, num_speculative_tokens: int, block_size: int, draft_runner: Any = None
) -> StepTimes | None:
    """The first two steps of the cost model (the module's recipe), timed on this runner (and
    the draft model's one-token step, if any); None if a KV pool is too small for them."""
    k = num_speculative_tokens
    runners = [runner] if draft_runner is None else [runner, draft_runner]
    if any(blocks_for(CONTEXT + 1 + k, block_size) > r.num_kv_blocks for r in runners):
        return None
    return StepTimes(
        plain=_step_seconds(runner, 0, block_size),
        verify=_step_seconds(runner, k, block_size),
        draft=0.0 if draft_runner is None else _step_seconds(draft_runner, 0, block_size),
    )


def with_wide_step(
    times: StepTimes, runner: Any, num_speculative_tokens: int, block_size: int
) -> StepTimes:
    """`times` with the third step, two sequences verifying k drafts each, timed on this
    runner; as they are where the pool cannot hold the two."""
    k = num_speculative_tokens
    if 2 * blocks_for(CONTEXT + 1 + k, block_size) > runner.num_kv_blocks:
        return times
    return replace(times, wide=_step_seconds(runner, k, block_size, 2, WIDE_ROUNDS))


def token_cost(times: StepTimes, num_speculative_tokens: int) -> float:
    """c from the first two steps, plus, with a draft model, what its one-token step costs per
    draft token as a share of the target's."""
    cost = draft_token_cost(times.verify / times.plain, num_speculative_tokens)
    return min(MAX_COST, cost + times.draft / times.plain)


def default_speculation_applies(config: EngineConfig, device_type: str) -> bool:
    """Whether an engine whose user left `speculative_config` unset speculates by default: on
    the CPU, in one process, without LoRA adapters (whose steps have not been measured with
    drafts). CUDA's decode steps are launch-bound CUDA graphs of one shape: not measured
    there either, so GPUs keep vLLM's default (off)."""
    return (
        config.speculative_config is None
        and device_type == "cpu"
        and config.tensor_parallel_size == 1
        and not config.enable_lora
    )


def with_default_speculation(
    config: EngineConfig, runner: Any, device_type: str, chosen: bool
) -> EngineConfig:
    """`config` with speculation measured on `runner`: the user's (`chosen`: a config or the
    off switch, `{"method": "none"}`) as given, else the default where it applies and pays."""
    if chosen or not default_speculation_applies(config, device_type):
        return with_measured_draft_cost(config, runner)
    default = replace(config, speculative_config=SpeculativeConfig(method="ngram"))
    return with_measured_draft_cost(default, runner, default=True)


def with_measured_draft_cost(
    config: EngineConfig, runner: Any, draft_runner: Any = None, default: bool = False
) -> EngineConfig:
    """The config with speculation's `draft_token_cost` measured on this runner (and draft
    model's runner, if any) when the user left it unset. `default`: the speculation is the
    engine's default, dropped (None) where it would not pay or cannot be measured."""
    spec = config.speculative_config
    if spec is None or spec.draft_token_cost is not None:
        return config
    k = spec.num_speculative_tokens
    store = _Store(runner, k, config.block_size, draft_runner)
    times = store.kept if store.holds_now(runner, config.block_size) else None
    if not times:
        with phase("timing decode steps for speculation's rule (kept for the next starts)"):
            times = store.keep(measure_step_times(runner, k, config.block_size, draft_runner))
    if times is None:
        return replace(config, speculative_config=None) if default else config
    cost = token_cost(times, k)
    best = best_speedup(cost, k)
    if best < MIN_BEST_SPEEDUP and default:
        logger.info(
            "speculative decoding off by default: fully accepted drafts would win %.2fx on "
            "this model here (draft_token_cost %.2f, below %.1fx)",
            best,
            cost,
            MIN_BEST_SPEEDUP,
        )
        return replace(config, speculative_config=None)
    if best < MIN_BEST_SPEEDUP:
        # The batch rule at 1 turns it off for every step; the counters stay at zero.
        logger.warning(
            "speculative decoding off: a verifying step of %d tokens costs %.1f one-token "
            "steps on this model here (draft_token_cost %.2f), so even fully accepted drafts "
            'would win only %.2fx; set "draft_token_cost": 0 to speculate anyway',
            1 + spec.num_speculative_tokens,
            (1 + cost * (1 + spec.num_speculative_tokens)) / (1 + cost),
            cost,
            best,
        )
        spec = replace(spec, disable_by_batch_size=1)
    else:
        # the third step only where speculation stays on: its batch limit decides nothing else
        if times.wide is None:
            times = store.keep(with_wide_step(times, runner, k, config.block_size))
        spec = _with_batch_limit(spec, batch_limit(times, k))
        logger.info(
            "speculative decoding%s: n-gram, draft_token_cost %.3f, measured on this model "
            "(fully accepted drafts: %.2fx), %s%s",
            " on by default" if default else "",
            cost,
            best,
            _batches(spec.disable_by_batch_size),
            '; --no-speculation or {"method": "none"} turns it off' if default else "",
        )
    return replace(config, speculative_config=replace(spec, draft_token_cost=cost))


class _Store:
    """The runner's step times kept from an earlier start (`step_times_store`), if any;
    `keep` keeps new ones for the next."""

    def __init__(self, runner: Any, k: int, block_size: int, draft_runner: Any) -> None:
        steps = [k, block_size, CONTEXT, ROUNDS, WIDE_ROUNDS]
        self._key = None if draft_runner else step_times_key(runner, steps)
        kept = load_step_times(self._key)
        try:
            self.kept = StepTimes(**kept) if kept is not None else None
        except TypeError:  # another version's fields
            self.kept = None

    def holds_now(self, runner: Any, block_size: int) -> bool:
        """Whether the kept times stand: a one-token step timed now is not notably faster than
        the kept one. Times taken on a busier machine (a first start beside a test suite made
        the coder's 1 + k step cost twice its share) would keep its drafts off for good; a
        start that finds the machine quieter times the steps again and keeps its times."""
        if self.kept is None:
            return False
        now = _step_seconds(runner, 0, block_size, rounds=1)
        return now >= QUIETER * self.kept.plain

    def keep(self, times: StepTimes | None) -> StepTimes | None:
        if times is not None and times != self.kept:
            save_step_times(self._key, asdict(times))
        return times


def _batches(limit: int | None) -> str:
    return "at any batch size" if limit is None else f"below {limit} running sequences"


def _with_batch_limit(spec: SpeculativeConfig, limit: int | None) -> SpeculativeConfig:
    """`spec` whose batch rule stops speculation at `limit` sequences too (the lower of the
    two)."""
    given = spec.disable_by_batch_size
    if limit is None or (given is not None and given <= limit):
        return spec
    return replace(spec, disable_by_batch_size=limit)
