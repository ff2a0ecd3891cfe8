"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat
template) and POST /detokenize (token ids back to text)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from minivllm.server.errors import bad_request
from minivllm.server.openai import protocol, response_models
from minivllm.server.openai.serving import OpenAIServer, json_response


async def tokenize(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, protocol.TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        tokens = await asyncio.to_thread(server.encode, req.prompt, add_special)
    else:
        tokens = await asyncio.to_thread(_chat_tokens, server, req)
    strs = [server.logprobs.token_text(t) for t in tokens] if req.return_token_strs else None
    return json_response(
        response_models.TokenizeResponse(
            count=len(tokens), max_model_len=server.max_model_len, tokens=tokens, token_strs=strs
        )
    )


def _chat_tokens(server: OpenAIServer, req: protocol.TokenizeRequest) -> list[int]:
    assert req.messages is not None
    try:
        messages = [m.template_dict() for m in req.messages]
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    text = server.chat_text(
        messages, req.add_generation_prompt, template_kwargs=req.chat_template_kwargs
    )
    return server.encode(text, add_special_tokens=bool(req.add_special_tokens))


async def detokenize(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, protocol.DetokenizeRequest)
    vocab = server.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
        )
    if server.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    text = await asyncio.to_thread(server.tokenizer.decode, req.tokens)
    return json_response(response_models.DetokenizeResponse(prompt=text))
