"""OpenAIServer: what every endpoint shares over one EngineClient: parsing a request body,
its sampling parameters, tokenizing, adding its choices (all or none) and collecting them.

The endpoints themselves live in `completions.py` and `chat.py`; `app.py` routes to them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from minivllm.engine import requests
from minivllm.engine.runtime.async_engine import (
    EngineDeadError,
    QueueFullError,
    RequestStream,
    ShuttingDownError,
)
from minivllm.engine.runtime.engine_client import EngineClient
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.errors import APIError, bad_request, bad_value, raise_if_failed
from minivllm.server.errors import validation_error as _validation_error
from minivllm.server.metrics import ServerMetrics
from minivllm.server.middleware import check_auth
from minivllm.server.openai import protocol, response_models
from minivllm.server.openai.constraints import Constraint
from minivllm.server.openai.logprobs import LogprobFormatter
from minivllm.server.openai.reasoning import PARSERS
from minivllm.structured import GrammarError, compile_grammar

logger = logging.getLogger("minivllm.server")

R = TypeVar("R", bound=BaseModel)


@dataclass(frozen=True)
class ChatOptions:
    """Server-wide chat settings: `minivllm serve --chat-template FILE
    --chat-template-kwargs JSON --reasoning-parser NAME`."""

    chat_template: str | None = None  # a Jinja template replacing the model's
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # request's win
    reasoning_parser: str | None = None  # reasoning.PARSERS

    def __post_init__(self) -> None:
        if self.reasoning_parser not in (None, *PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {PARSERS}, got {self.reasoning_parser!r}"
            )


class OpenAIServer:
    """The endpoints' shared state and steps, over one EngineClient (`engine`)."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        api_key: str | None,
        max_waiting_requests: int | None,
        chat: ChatOptions | None = None,
    ) -> None:
        chat = chat or ChatOptions()
        self.chat_template = chat.chat_template
        self.chat_template_kwargs = dict(chat.chat_template_kwargs)
        self.reasoning_parser = chat.reasoning_parser
        self.engine = engine
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.metrics = ServerMetrics(lambda: engine.stats, served_model_name)
        engine.on_output = self.metrics.on_output
        engine.max_waiting_requests = max_waiting_requests
        self.vocab_size = engine.vocab_size
        self.logprobs = LogprobFormatter(self.tokenizer)
        # The model's sampling defaults (generation_config.json) for fields a request leaves
        # unset; a request's own value wins.
        self.default_sampling = dict(engine.default_sampling_params)
        if self.default_sampling:
            logger.info("default sampling params from the model: %s", self.default_sampling)

    def check_auth(self, request: Request) -> None:
        check_auth(request, self.api_key)

    async def parse(self, request: Request, model: type[R]) -> R:
        """The authorised request's body as `model`: 400 for bad bytes, JSON or fields, 404
        for a model this server does not serve."""
        self.check_auth(request)
        body = await request.body()
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad_request(f"the request body is not valid UTF-8: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        unsupported: list[str] = (
            parsed.unsupported_fields() if isinstance(parsed, protocol._Body) else []
        )
        if unsupported:
            raise bad_request(
                f"this server does not implement {', '.join(map(repr, unsupported))}: remove "
                "the field (an answer that ignored it would not be the one asked for)",
                param=unsupported[0],
            )
        name = getattr(parsed, "model", None)
        if name not in (None, self.served_model_name, *self.engine.loras.names()):
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        return parsed

    async def sampling_params(
        self, req: protocol._SamplingRequest, default_max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """The request's SamplingParams (the model's defaults for the fields it leaves unset),
        its output constraint included; 400 if invalid."""
        try:
            params = req.sampling_params(default_max_tokens, logprobs, self.default_sampling)
            constraint = req.constraint()
        except ValueError as exc:
            raise bad_value(exc) from None
        return await self.constrain(params, constraint)

    def fit_default_max_tokens(
        self, req: protocol._SamplingRequest, params: SamplingParams, prompt_len: int
    ) -> SamplingParams:
        """vLLM's rule for a max_tokens the request did not set: the model's default is cut to
        the room the prompt leaves in max_model_len (a request's own value is checked, not cut);
        400 if min_tokens no longer fits."""
        if req.max_tokens is not None or req.max_completion_tokens is not None:
            return params
        if params.max_tokens is None or self.max_model_len is None:
            return params
        room = self.max_model_len - prompt_len
        if not 0 < room < params.max_tokens:
            return params  # fits, or the prompt alone is too long (a 400 when it is added)
        try:
            return dataclasses.replace(params, max_tokens=room)
        except ValueError as exc:
            raise bad_value(exc) from None

    async def constrain(
        self, params: SamplingParams, constraint: Constraint | None
    ) -> SamplingParams:
        """`params` with the request's structured-output spec, compiled here (and cached) so
        that a bad schema, regex or grammar is a 400 naming the field it came from."""
        if constraint is None:
            return params
        spec, field = constraint
        try:
            await asyncio.to_thread(compile_grammar, spec)
        except GrammarError as exc:
            raise bad_request(f"{field} is invalid: {exc.reason}", param=field) from None
        return dataclasses.replace(params, structured_outputs=spec)

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation through the chat template (the server's --chat-template, else the
        model's), with the template kwargs (the server's defaults, then the request's); 400 if
        there is no template or it rejects the messages."""
        try:
            return requests.chat_text(
                self.tokenizer,
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template=self.chat_template,
                chat_template_kwargs={**self.chat_template_kwargs, **(template_kwargs or {})},
            )
        except requests.NoChatTemplateError:
            raise bad_request("this model has no chat template: use /v1/completions") from None
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None

    def encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise bad_request("the prompt is empty: give at least one token", param="prompt")
        if self.max_model_len is not None and len(token_ids) >= self.max_model_len:
            raise bad_request(
                f"the prompt has {len(token_ids)} tokens, but this model's max_model_len is "
                f"{self.max_model_len}: shorten the prompt",
                param="prompt",
            )

    async def start(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        model: str | None = None,
    ) -> RequestStream:
        """Add n choices per prompt (seed + i for choice i when seeded), all or none; under
        the LoRA adapter `model` names, if it names one."""
        for prompt in prompts:
            self.check_prompt(prompt)
        choices = requests.fan_out(list(prompts), [params] * len(prompts))
        return await self.add(request_id, choices, model)

    async def add(
        self, request_id: str, choices: list[requests.Choice], model: str | None = None
    ) -> RequestStream:
        """Add the choices as one request, all or none; the engine's refusals as HTTP errors."""
        try:
            lora = None if model in (None, self.served_model_name) else self.engine.loras.get(model)
            return await self.engine.add_request(request_id, choices, lora)
        except QueueFullError as exc:
            raise APIError(503, str(exc), type="service_unavailable", code="overloaded") from None
        except ShuttingDownError as exc:
            raise APIError(
                503, str(exc), type="service_unavailable", code="shutting_down"
            ) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="service_unavailable", code="engine_dead") from None
        except (ValueError, TypeError) as exc:
            raise bad_value(exc) from None

    async def collect(
        self, request: Request, stream: RequestStream, num_choices: int
    ) -> list[RequestOutput]:
        """The final output of every choice; aborts if the client disconnects first."""
        finals: list[RequestOutput | None] = [None] * num_choices

        async def drain() -> None:
            async for index, output in stream:
                if output.finished:
                    finals[index] = output

        drain_task = asyncio.ensure_future(drain())
        watch_task = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({drain_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_task.cancel()
            if not drain_task.done():
                drain_task.cancel()
            stream.close()
        if not drain_task.done() or drain_task.cancelled():
            raise APIError(499, "the client disconnected", code="client_disconnected")
        drain_task.result()
        outputs = [f for f in finals if f is not None]
        for output in outputs:
            raise_if_failed(output)
        return outputs

    def log_finished(
        self, request_id: str, prompt_tokens: int, completion_tokens: int, start: float, how: str
    ) -> None:
        logger.info(
            "request %s %s: prompt_tokens=%d completion_tokens=%d latency=%.3fs",
            request_id,
            how,
            prompt_tokens,
            completion_tokens,
            time.monotonic() - start,
        )


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def usage_of(prompt_tokens: int, outputs: list[RequestOutput], n: int) -> response_models.Usage:
    """Usage of a request's final outputs (n choices per prompt, prompt-major): each prompt
    counted once, its cached tokens those of its first choice."""
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_prompt_tokens for o in outputs[::n])
    return response_models.make_usage(prompt_tokens, completion, cached)


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
