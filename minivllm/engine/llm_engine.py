"""LLMEngine: one step is plan (Scheduler.schedule), execute (ModelRunner.run), commit
(Scheduler.postprocess). Around that: requests in (tokenized here), token outputs out
(`EngineOutput`: no text; the runtime's OutputProcessor detokenizes and applies stop strings,
calling back `stop_sequence`), and the optional tracer the lab reads.

The engine knows the model only through a runner with `num_kv_blocks`, `vocab_size` and
`run(batch, token_bitmask) -> RunnerOutput`, so tests drive it with a fake runner and no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from minivllm.config import EngineConfig
from minivllm.engine.engine_output import EngineOutput
from minivllm.engine.generation_config import default_sampling_params, with_eos_token_ids
from minivllm.engine.lora_registry import LoRARegistry, LoRASlots
from minivllm.engine.runner_output import RunnerOutput
from minivllm.engine.scheduler import ScheduledBatch, Scheduler
from minivllm.engine.sequence import FinishReason, Sequence
from minivllm.engine.spec_decode import Proposer
from minivllm.engine.tracing import NullTracer
from minivllm.lora_request import LoRARequest
from minivllm.outputs import CompletionOutput, RequestMetrics
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.startup import phase
from minivllm.structured import GrammarMatcher, StructuredOutputs

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]


class ModelRunnerLike(Protocol):
    """What the engine needs of a runner: ModelRunner, TPModelRunner and the tests' fakes."""

    num_kv_blocks: int
    vocab_size: int

    def run(self, batch: ScheduledBatch, token_bitmask: Any = None) -> RunnerOutput:
        """Execute the plan (writing no Sequence field); `token_bitmask`: the structured
        outputs' allowed tokens, int32 [len(batch.sample_seqs), ceil(vocab / 32)], or None."""
        ...


@dataclass
class _Request:
    """The engine's bookkeeping for one sequence, beside the state machine itself."""

    request_id: str
    prompt: str | None
    seq: Sequence
    metrics: RequestMetrics
    num_cached_prompt_tokens: int | None = None  # set at admission (prefix-cache hits)
    error: str | None = None
    matcher: GrammarMatcher | None = None  # where a structured output is in its grammar


class LLMEngine:
    """Steps requests through WAITING -> RUNNING -> FINISHED on a model runner."""

    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunnerLike,
        tokenizer: Any | None = None,
        tracer: NullTracer | None = None,
        default_sampling_params: dict[str, Any] | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        # The model's sampling defaults by SamplingParams' names (generation_config.py).
        self.default_sampling_params = dict(default_sampling_params or {})
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.tracer = tracer or NullTracer()
        self.scheduler = Scheduler(
            config, model_runner.num_kv_blocks, draft_filter=self._grammar_drafts, proposer=proposer
        )
        self.structured = StructuredOutputs(
            tokenizer, model_runner.vocab_size, config.eos_token_ids
        )
        self._requests: dict[int, _Request] = {}
        self.loras = LoRARegistry(config)  # the named adapters (the server's `model` names)
        self._next_seq_id = 0  # taken only by an accepted request: a refusal uses no id

    @classmethod
    def from_options(
        cls,
        tracer: NullTracer | None = None,
        on_resolved: Callable[[Path], None] | None = None,
        decode_only_tokenizer: bool = False,
        **options: Any,
    ) -> LLMEngine:
        """Build an engine on a real model: `model` (HF dir, .gguf, or None for the default)
        and any EngineConfig option (a draft model's speculative config loads the draft too).
        `on_resolved` is called with the model's directory as soon as it is known.
        `decode_only_tokenizer`: its requests will come as token ids (the server's engine
        process), so its tokenizer loads for decoding (`minivllm.tokenizer.load_decoder`)."""
        with phase("importing the model code (torch's compiler, transformers)"):
            from minivllm.engine.draft_model import load_draft_proposer, resolve_draft
            from minivllm.engine.memory import collapse_to_huge_pages, fit_max_model_len
            from minivllm.engine.model_runner import ModelRunner
            from minivllm.engine.pooling_config import with_pooling
            from minivllm.engine.spec_cost import with_default_speculation, with_measured_draft_cost
            from minivllm.heap import release_free_heap
            from minivllm.models.config import resolve_config
            from minivllm.tokenizer import load_decoder, load_tokenizer

        config = EngineConfig.from_options(**options)
        config, model_dir, hf_config = resolve_config(config)
        if on_resolved is not None:
            on_resolved(model_dir)
        with phase("loading the tokenizer"):
            tokenizer = (load_decoder if decode_only_tokenizer else load_tokenizer)(model_dir)
        config = with_pooling(with_eos_token_ids(config, tokenizer, model_dir), model_dir)
        draft = resolve_draft(config, hf_config)  # a bad draft fails before any weight is read
        defaults = default_sampling_params(config.generation_config, model_dir)
        if config.tensor_parallel_size > 1:
            from minivllm.engine.tp_runner import TPModelRunner

            runner: ModelRunnerLike = TPModelRunner(config, model_dir, hf_config)
        else:
            runner = ModelRunner(config, model_dir, hf_config)
        config = fit_max_model_len(
            config,
            runner.num_kv_blocks,
            getattr(runner, "memory", None),
            max_model_len_given=options.get("max_model_len") is not None,
        )
        proposer = load_draft_proposer(config, draft, runner.num_kv_blocks) if draft else None
        if proposer is not None:
            config = with_measured_draft_cost(config, runner, proposer.runner)
        else:  # the user's n-gram config, the off switch, or unset: the default's rule
            chosen = options.get("speculative_config") is not None
            device_type = getattr(getattr(runner, "device", None), "type", "")  # TP: none
            config = with_default_speculation(config, runner, device_type, chosen)
        if isinstance(runner, ModelRunner):  # now that start-up timed what it measures
            collapse_to_huge_pages(runner.model, runner.mapped)
        release_free_heap()  # what the load and the conversion freed (minivllm/heap.py)
        return cls(config, runner, tokenizer, tracer, defaults, proposer)

    def close(self) -> None:
        """Release the runner's processes, if it has any (tensor parallelism); idempotent."""
        close = getattr(self.model_runner, "close", None)
        if close is not None:
            close()

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Sequence:
        """Queue a request; ValueError if it is malformed or could never fit. With
        PoolingParams it is an embedding request: its prompt runs, pooled, and it ends. With
        `lora_request` it runs under that adapter (loaded now if it is not resident)."""
        pooling = None
        if isinstance(sampling_params, PoolingParams):  # the engine's method unless it names one
            method = sampling_params.method or self.config.pooling or "last"
            pooling, sampling_params = replace(sampling_params, method=method), None
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {sampling_params!r}")
        text, token_ids = self._tokenize(prompt)
        vocab = self.model_runner.vocab_size
        outside = [t for t in sampling_params.logit_bias or {} if t >= vocab]
        if outside:
            raise ValueError(
                f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})"
            )
        matcher = self.structured.matcher_for(sampling_params)  # GrammarError: a bad spec
        self._add_lora(lora_request)
        seq_id = self._next_seq_id
        with self.tracer.phase("add"):
            seq = self.tracer.new_sequence(seq_id, token_ids, sampling_params)
            seq.pooling = pooling
            seq.lora_int_id = lora_request.lora_int_id if lora_request else 0
            self.scheduler.add(seq)
        self._next_seq_id += 1
        request_id = str(seq_id) if request_id is None else request_id
        self._requests[seq_id] = _Request(
            request_id, text, seq, RequestMetrics(seq.arrival_time), matcher=matcher
        )
        return seq

    def _add_lora(self, lora_request: LoRARequest | None) -> None:
        """Make a request's adapter resident, evicting only one no unfinished request uses."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if not self.config.enable_lora:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora")
        slots = getattr(self.model_runner, "lora", None)
        if not isinstance(slots, LoRASlots):
            raise ValueError("this engine's runner serves no LoRA adapters")
        slots.add(lora_request, {r.seq.lora_int_id for r in self._requests.values()})

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, (list, tuple)):
            vocab = self.model_runner.vocab_size
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {prompt!r}")

    def abort_request(self, seq_id: int) -> bool:
        """Finish a request in any state and free all it holds. False if it is unknown."""
        request = self._requests.pop(seq_id, None)
        if request is None:
            return False
        with self.tracer.phase("abort"):
            self.scheduler.finish(request.seq, FinishReason.ABORT)
        return True

    def stop_sequence(self, seq: Sequence, num_completion_tokens: int) -> None:
        """End `seq` with "stop" where the output processor found a stop string, keeping its
        first `num_completion_tokens` (a speculative step may have appended tokens past it);
        a sequence that finished in the same step only changes its reason."""
        with self.tracer.phase("commit"):  # the step's commit, finished by its text
            self.scheduler.finish(seq, FinishReason.STOP)  # a no-op if it finished already
            seq.finish_reason = FinishReason.STOP
            if num_completion_tokens < seq.num_completion_tokens:
                seq.truncate(seq.num_prompt_tokens + num_completion_tokens)
        self._requests.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One engine step: plan, then execute and commit."""
        batch = self.plan()
        return self.execute_and_commit(batch)

    def plan(self) -> ScheduledBatch:
        """Plan: Scheduler.schedule writes num_scheduled_tokens and allocates blocks."""
        self.tracer.next_step()
        with self.tracer.phase("plan"):
            batch = self.scheduler.schedule()
        for seq in batch.seqs:
            request = self._requests.get(seq.seq_id)
            if request is not None and request.num_cached_prompt_tokens is None:
                request.num_cached_prompt_tokens = seq.num_cached_tokens
        return batch

    def execute_and_commit(self, batch: ScheduledBatch) -> list[EngineOutput]:
        """Execute: ModelRunner.run. Commit: Scheduler.postprocess, only if the run worked."""
        batch = batch.without_finished()
        if batch.is_empty:
            return []
        failure: Exception | None = None
        bitmask = self.structured.bitmask(
            self._matchers(batch.sample_seqs), [s.spec_token_ids for s in batch.sample_seqs]
        )
        num_tokens = [seq.num_tokens for seq in batch.sample_seqs]  # where new tokens start
        with self.tracer.phase("execute"):
            try:
                output = self.model_runner.run(batch, bitmask)
            except Exception as exc:  # the plan is dropped; the engine stays usable
                logger.exception(
                    "ModelRunner.run failed; ending the %d sequences of this batch", len(batch.seqs)
                )
                failure = exc
            else:
                self.tracer.record_execute(batch, output, self.model_runner)
        with self.tracer.phase("commit"):
            if failure is not None:
                return self._fail(batch, failure)
            seqs = self.scheduler.postprocess(batch, output)
            self._advance_grammars(batch.sample_seqs, num_tokens)
            return self._outputs(seqs, sampled=set(map(id, batch.sample_seqs)))

    def _matchers(self, seqs: list[Sequence]) -> list[GrammarMatcher | None]:
        requests = [self._requests.get(seq.seq_id) for seq in seqs]
        return [r.matcher if r is not None else None for r in requests]

    def _grammar_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts a constrained sequence's grammar allows in a row (all, if none)."""
        request = self._requests.get(seq.seq_id)
        if request is None or request.matcher is None:
            return drafts
        return drafts[: request.matcher.valid_prefix(drafts)]

    def _advance_grammars(self, seqs: list[Sequence], starts: list[int]) -> None:
        """Feed each constrained sequence's new tokens (from `starts`) to its grammar; end it
        with "stop" where the grammar ends, dropping any token a speculative step appended
        after that point (a step without drafts would have ended there)."""
        for seq, matcher, start in zip(seqs, self._matchers(seqs), starts):
            if matcher is None:
                continue
            for at in range(start, seq.num_tokens):
                if matcher.is_finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    seq.finish_reason = FinishReason.STOP
                    seq.truncate(at)
                    break
                matcher.accept(seq.token_ids[at])
            if matcher.is_finished and not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP)

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[EngineOutput]:
        self.scheduler.discard(batch, FinishReason.ERROR)
        for seq in batch.seqs:
            request = self._requests.get(seq.seq_id)
            if request is not None:
                request.error = f"{type(exc).__name__}: {exc}"
        return self._outputs(batch.seqs, sampled=set())

    # ---- outputs --------------------------------------------------------------------------

    def _outputs(self, seqs: list[Sequence], sampled: set[int]) -> list[EngineOutput]:
        now = time.monotonic()
        outputs = []
        for seq in seqs:
            request = self._requests.get(seq.seq_id)
            if request is None or (id(seq) not in sampled and not seq.is_finished):
                continue
            if id(seq) in sampled and request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if seq.is_finished:
                request.metrics.finished_time = now
                del self._requests[seq.seq_id]
            outputs.append(self.make_output(request))
        return outputs

    def make_output(self, request: _Request) -> EngineOutput:
        """The request's tokens as committed so far (no text: the OutputProcessor's job)."""
        seq = request.seq
        sp = seq.sampling_params
        prompt_logprobs = None if sp.prompt_logprobs is None else [None, *seq.prompt_logprobs]
        completion = CompletionOutput(
            index=0,
            text="",
            token_ids=list(seq.completion_token_ids),
            # the API speaks vLLM's plain strings
            finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
            logprobs=None if sp.logprobs is None else list(seq.logprobs),
        )
        return EngineOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=seq.is_finished,
            metrics=request.metrics,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens or 0,
            prompt_logprobs=prompt_logprobs,
            error=request.error,
            embedding=seq.embedding,
            seq=seq,
        )

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters for metrics: queue sizes, KV usage, prefix cache, preemptions, speculation,
        and the memory the runner measured at start-up."""
        bm = self.scheduler.block_manager
        memory = getattr(self.model_runner, "memory", None)  # a real runner's MemoryReport
        return {
            **(memory.gauges() if memory is not None else {}),
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": bm.usage,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.scheduler.spec_stats.as_stats(),
            **(self.scheduler.proposer.stats() if self.scheduler.proposer else {}),
        }
