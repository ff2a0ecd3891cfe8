"""The execute -> commit seam: the runner returns a RunnerOutput and writes nothing into the
plan; Scheduler.postprocess commits what the output holds. No torch."""

from __future__ import annotations

import dataclasses

import pytest

from minivllm.config import EngineConfig
from minivllm.engine.runner_output import RunnerOutput, SampledToken
from minivllm.engine.scheduler import ScheduledBatch, Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.logprobs import Logprob
from minivllm.sampling_params import SamplingParams


def _scheduler() -> Scheduler:
    return Scheduler(EngineConfig(block_size=4, max_model_len=64), 16)


def _entry(token_id: int) -> dict[int, Logprob]:
    return {token_id: Logprob(-1.0, 1)}


def test_the_plan_has_no_field_for_the_runner_to_fill() -> None:
    """Guards the seam: results travel in RunnerOutput, never written back into the plan."""
    names = {f.name for f in dataclasses.fields(ScheduledBatch)}
    assert names == {"seqs", "preempted", "sample_seqs"}


def test_postprocess_commits_prompt_logprobs_from_the_output_skipping_recomputed() -> None:
    """Prompt logprobs come from the output; positions already committed (a recompute after
    preemption covers them again) are not appended twice."""
    scheduler = _scheduler()
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    seq = Sequence(0, [5, 6, 7, 8, 9], params)
    scheduler.add(seq)
    seq.prompt_logprobs.append(_entry(6))  # position 1 committed by an earlier run
    batch = scheduler.schedule()
    output = RunnerOutput(
        samples=[SampledToken(3)],
        prompt_logprobs={0: (1, [_entry(6), _entry(7), _entry(8), _entry(9)])},
    )
    scheduler.postprocess(batch, output)
    assert [list(e) for e in seq.prompt_logprobs] == [[6], [7], [8], [9]]
    assert seq.completion_token_ids == [3]
    assert output.sampled_token_ids == [3]


def test_postprocess_refuses_an_output_with_the_wrong_number_of_samples() -> None:
    scheduler = _scheduler()
    scheduler.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=2)))
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="expected 1 samples"):
        scheduler.postprocess(batch, RunnerOutput())
