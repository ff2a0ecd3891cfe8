"""Building requests: one path for the Python API (`LLM`) and the HTTP server.

- `as_prompt_list`: one prompt or a batch of them (strings, token ids, prompt dicts) as a list.
- `check_conversation` and `chat_prompt`: a conversation through the model's chat template.
- `fan_out`: the n samples of each prompt as n requests of n=1, seed + i for sample i, so a
  seeded request gives the same n samples whatever the batch they run in.
- `add_all`: add requests to an engine, all or none, so a bad prompt in a batch leaves
  nothing half-added behind.

Errors are ValueError/TypeError with a message for the user; the server turns them into 400s.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any, cast

from minivllm.engine.llm_engine import LLMEngine, PromptInput
from minivllm.engine.sequence import Sequence
from minivllm.lora_request import LoRARequest
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams

Message = dict[str, Any]
# One request of n=1: its prompt and sampling (PoolingParams: an embedding request).
Choice = tuple[PromptInput, SamplingParams | PoolingParams]


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template (or there is no tokenizer)."""


def as_prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
    """One prompt (a string, token ids, {"prompt"...} dict) or a list of them, as a list."""
    if not isinstance(prompts, (str, dict, list, tuple)):
        raise TypeError(
            "prompts must be a string, a list of token ids, a dict, or a list of those, "
            f"got {prompts!r:.80}"
        )
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # one prompt given as token ids
    items = cast(Seq[PromptInput], prompts)  # a list of prompts: ids lists were handled above
    return [list(p) if isinstance(p, tuple) else p for p in items]


def as_conversation_list(messages: Any) -> list[list[Message]]:
    """One conversation (a list of message dicts) or a list of them, checked, as a list."""
    if not isinstance(messages, list):
        raise TypeError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {messages!r:.80}"
        )
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    for conv in conversations:
        check_conversation(conv)
    return conversations


def check_conversation(conv: object) -> None:
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


def chat_text(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> str:
    """The conversation as the model's chat template writes it (or `chat_template`'s).

    NoChatTemplateError if there is no template; ValueError if the template rejects the
    messages (jinja raises those as any exception)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise NoChatTemplateError("this model has no chat template")
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            **kwargs,
        )
    except Exception as exc:  # jinja's errors, raise_exception() in templates, bad kwargs
        raise ValueError(f"the chat template rejected the messages: {exc}") from None


def chat_prompt(tokenizer: Any, messages: list[Message], **options: Any) -> list[int]:
    """The conversation's token ids through the chat template (options: `chat_text`'s).

    The template writes the special tokens (BOS, role markers) itself: none are added."""
    text = chat_text(tokenizer, messages, **options)
    return list(tokenizer.encode(text, add_special_tokens=False))


def fan_out(prompts: list[PromptInput], params: Seq[SamplingParams]) -> list[Choice]:
    """Prompt i's `params[i].n` samples as requests of n=1, in order (prompt, then sample)."""
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
    return [(prompt, nth_sample(p, j)) for prompt, p in zip(prompts, params) for j in range(p.n)]


def nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: the same params with n=1 (and seed + j when seeded)."""
    seed = None if params.seed is None else params.seed + j
    return replace(params, n=1, seed=seed)


def add_all(
    engine: LLMEngine,
    choices: list[Choice],
    request_ids: list[str],
    loras: Seq[LoRARequest | None] | None = None,
) -> list[Sequence]:
    """Add one request per choice (under `loras[i]`'s adapter, if given), all or none: if
    one fails, those added are aborted and the error propagates."""
    added: list[Sequence] = []
    loras = loras or [None] * len(choices)
    try:
        for (prompt, params), request_id, lora in zip(choices, request_ids, loras, strict=True):
            added.append(engine.add_request(prompt, params, request_id, lora_request=lora))
    except Exception:
        for seq in added:
            engine.abort_request(seq.seq_id)
        raise
    return added
