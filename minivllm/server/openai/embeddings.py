"""POST /v1/embeddings (OpenAI's shape): `input` as a string, a list of strings, a list of
token ids or a list of those, each pooled by the engine (`pooling`, L2-normalized) through
the same scheduler as the completions; `encoding_format` float or base64 (little-endian
float32, what the openai SDK decodes). `dimensions` (Matryoshka truncation) is refused by
name: none of the models this engine loads declares that its vectors may be cut."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Literal, cast

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from minivllm.engine.llm_engine import PromptInput
from minivllm.pooling_params import PoolingParams
from minivllm.server.errors import bad_request
from minivllm.server.openai.protocol import _Body
from minivllm.server.openai.serving import OpenAIServer, json_response

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Body):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


async def create_embedding(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, EmbeddingRequest)
    if req.dimensions is not None:
        raise bad_request(
            "dimensions: this model's embeddings cannot be shortened (it declares no "
            "Matryoshka dimensions); remove the field",
            param="dimensions",
        )
    prompts = [await _token_ids(server, item) for item in _items(req.input)]
    request_id = f"embd-{uuid.uuid4().hex}"
    stream = await server.add(request_id, [(p, PoolingParams()) for p in prompts])
    outputs = await server.collect(request, stream, len(prompts))
    data = []
    for index, output in enumerate(outputs):
        assert output.embedding is not None  # a finished pooling request that did not fail
        data.append(EmbeddingData(index=index, embedding=_encode(output.embedding, req)))
    num_tokens = sum(map(len, prompts))
    return json_response(
        EmbeddingResponse(
            id=request_id,
            created=int(time.time()),
            model=server.served_model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
    )


def _items(value: EmbeddingInput) -> list[str | list[int]]:
    """The inputs one by one: a string or a token-id list is one input."""
    if not value:
        raise bad_request("input is empty: give a string, token ids, or a list of them", "input")
    if isinstance(value, str):
        return [value]
    if all(isinstance(v, int) for v in value):
        return [cast(list[int], value)]
    return cast(list[str | list[int]], list(value))


async def _token_ids(server: OpenAIServer, item: str | list[int]) -> PromptInput:
    """One input's token ids (a string through the tokenizer, as completions do), checked
    against the model's length; the engine checks the ids against its vocabulary."""
    if not item:
        raise bad_request("input is empty: give a non-empty string or token ids", "input")
    ids = await asyncio.to_thread(server.encode, item, True) if isinstance(item, str) else item
    limit = server.max_model_len
    if limit is not None and len(ids) > limit:
        raise bad_request(
            f"input has {len(ids)} tokens, but this model's max_model_len is {limit}: shorten it",
            param="input",
        )
    return list(ids)


def _encode(embedding: list[float], req: EmbeddingRequest) -> list[float] | str:
    if req.encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
