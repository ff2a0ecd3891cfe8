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

The same measurement decides the default (`with_default_speculation`): on the CPU, an engine
whose user left `speculative_config` unset gets n-gram speculation (vLLM's keys, k = 4), kept
only where fully accepted drafts would win `MIN_BEST_SPEEDUP`. A 1.5B model on a 2-core CPU
reads its weights once for 1 or 5 tokens alike, so drafts pay there; the 135M default model's
5-token step costs more than two 1-token ones, so it decodes without (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from minivllm.config import EngineConfig, SpeculativeConfig
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.paging import blocks_for
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CONTEXT = 32  # tokens already cached before the timed steps
ROUNDS = 5
MAX_COST = 100.0  # r at or past 1 + k: a token costs a step, so drafts never pay
# Below this best case (every draft accepted) speculation is left off: what it could win is
# within what the cost model misses (probes, partial acceptance, larger batches); with a best
# case below it, open chat lost and quoting answers barely won (docs/benchmarks.md,
# "Speculative decoding on chat workloads").
MIN_BEST_SPEEDUP = 2.0


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


def _plan(num_drafts: int, block_size: int) -> ScheduledBatch:
    """One sequence with CONTEXT cached tokens running its last token and `num_drafts`
    drafts (0: a plain decode step)."""
    seq = Sequence(-1, [0] * (CONTEXT + 1), SamplingParams(temperature=0.0, max_tokens=16))
    seq.status = SequenceStatus.RUNNING
    seq.num_cached_tokens = CONTEXT
    seq.spec_token_ids = [0] * num_drafts
    seq.num_scheduled_tokens = 1 + num_drafts
    seq.block_table = list(range(blocks_for(CONTEXT + 1 + num_drafts, block_size)))
    return ScheduledBatch([seq])


def _step_seconds(runner: Any, num_drafts: int, block_size: int) -> float:
    best = float("inf")
    for _ in range(ROUNDS + 1):  # the first run warms up this step's shape
        plan = _plan(num_drafts, block_size)
        start = time.perf_counter()
        runner.run(plan)
        best = min(best, time.perf_counter() - start)
    return best


def measure_draft_token_cost(
    runner: Any, num_speculative_tokens: int, block_size: int, draft_runner: Any = None
) -> float | None:
    """c for this runner's model (the module's recipe), plus, with a draft model, what the
    draft's own one-token step costs per draft token as a share of the target's; None if a
    KV pool is too small to time the steps in."""
    k = num_speculative_tokens
    runners = [runner] if draft_runner is None else [runner, draft_runner]
    if any(blocks_for(CONTEXT + 1 + k, block_size) > r.num_kv_blocks for r in runners):
        return None
    plain = _step_seconds(runner, 0, block_size)
    verify = _step_seconds(runner, k, block_size)
    cost = draft_token_cost(verify / plain, k)
    if draft_runner is not None:
        cost += _step_seconds(draft_runner, 0, block_size) / plain
    return min(MAX_COST, cost)


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
    cost = measure_draft_token_cost(
        runner, spec.num_speculative_tokens, config.block_size, draft_runner
    )
    if cost is None:
        return replace(config, speculative_config=None) if default else config
    best = best_speedup(cost, spec.num_speculative_tokens)
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
        logger.info(
            "speculative decoding%s: n-gram, draft_token_cost %.3f, measured on this model "
            "(fully accepted drafts: %.2fx)%s",
            " on by default" if default else "",
            cost,
            best,
            '; --no-speculation or {"method": "none"} turns it off' if default else "",
        )
    return replace(config, speculative_config=replace(spec, draft_token_cost=cost))
