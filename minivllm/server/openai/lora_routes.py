"""vLLM's LoRA endpoints: `POST /v1/load_lora_adapter` {lora_name, lora_path} names an adapter
(its files checked now, read into a slot by the first request for it) and
`POST /v1/unload_lora_adapter` {lora_name} forgets it. A request whose `model` is an adapter's
name runs under it; `/v1/models` lists the adapters with `parent` = the base model."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from minivllm.server.errors import APIError, bad_value
from minivllm.server.openai import response_models
from minivllm.server.openai.serving import OpenAIServer


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; the name decides


def adapter_cards(server: OpenAIServer) -> list[response_models.ModelCard]:
    """A model card per named adapter, its parent the base model."""
    loras = server.engine.loras
    cards = []
    for name in loras.names():
        try:
            request = loras.get(name)
        except ValueError:  # unloaded meanwhile
            continue
        cards.append(
            response_models.ModelCard(
                id=name,
                root=request.lora_path,
                parent=server.served_model_name,
                max_model_len=server.max_model_len,
            )
        )
    return cards


def lora_routes(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await server.parse(request, LoadLoRARequest)
        if body.lora_name == server.served_model_name:
            raise APIError(400, "lora_name is the base model's name", param="lora_name")
        try:  # reading the files: off the event loop
            await asyncio.to_thread(server.engine.loras.add, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise bad_value(exc) from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await server.parse(request, UnloadLoRARequest)
        try:
            server.engine.loras.remove(body.lora_name)
        except ValueError as exc:
            code = 404 if "no LoRA adapter" in str(exc) else 400
            raise APIError(code, str(exc), param="lora_name") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
