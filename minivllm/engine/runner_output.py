"""What the ModelRunner hands back for one executed plan (vLLM v1's `ModelRunnerOutput`).

The seam between execute and commit is typed both ways: the runner takes the plan
(`ScheduledBatch`, written by the Scheduler) and the grammar bitmask (filled by the engine),
and returns a `RunnerOutput`, which `Scheduler.postprocess` commits. The runner writes nothing
into the plan and no Sequence field.

Pure Python: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.logprobs import Logprob


@dataclass
class SampledToken:
    """What the ModelRunner returns for one sequence of `ScheduledBatch.sample_seqs`."""

    token_id: int
    # When logprobs were asked for: the sampled token's and the top-N's Logprob, by token id.
    logprobs: dict[int, Logprob] | None = None
    # With draft tokens in the plan: how many of them the target accepted; `token_id` is the
    # target's token after them (a correction, or the bonus when all were accepted).
    num_accepted: int = 0
    # With accepted drafts and logprobs: each accepted draft's entry, in order.
    draft_logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RunnerOutput:
    """One executed plan's results, filled by the runner, committed by `Scheduler.postprocess`."""

    # One per sequence of the plan's `sample_seqs`, in that order.
    samples: list[SampledToken] = field(default_factory=list)
    # For sequences that asked for prompt logprobs: seq_id -> (first prompt position covered,
    # one {token_id: Logprob} per position from there); a recompute may repeat positions.
    prompt_logprobs: dict[int, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # For the embedding sequences of the plan (`Sequence.pooling` set): seq_id -> the partial
    # pool over their positions so far (opaque to the engine: the runner's tensor), for those
    # whose prompt is not complete yet; seq_id -> the final pooled vector, for those whose is.
    pooled: dict[int, Any] = field(default_factory=dict)
    embeddings: dict[int, list[float]] = field(default_factory=dict)

    @property
    def sampled_token_ids(self) -> list[int]:
        """The target's token of each sampling sequence (after its accepted drafts, if any)."""
        return [s.token_id for s in self.samples]
