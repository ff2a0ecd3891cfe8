"""What the engine returns, in vLLM's shape: a RequestOutput per request (an
EmbeddingRequestOutput per prompt from `LLM.embed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running; a FinishReason value
    # With SamplingParams.logprobs: one dict per generated token, token id -> Logprob (the
    # top-N plus the sampled token, each with its rank and decoded text). vLLM's shape.
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step, cumulative (the whole text so far, not a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per
    # prompt token, token id -> Logprob (the top-N plus the prompt's own token). vLLM's shape.
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
    # An embedding request's pooled vector (PoolingParams), once finished; else None.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's pooled vector (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's `EmbeddingRequestOutput`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
