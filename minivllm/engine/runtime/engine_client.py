"""EngineClient: the one interface the HTTP server talks to an engine through (vLLM's
`EngineClient` protocol).

Two implementations: `AsyncLLMEngine` (async_engine.py: the engine loop on a thread of this
process) and `EngineProcess` (engine_process.py: the loop in a process of its own). The server
(`server/app.py`, `server/openai/serving.py`) reads the model's facts and drives requests
through this protocol only; `client_for` is the one place an `LLMEngine` of this process
becomes a client.
"""

from __future__ import annotations

from typing import Any, Protocol

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.lora_registry import LoRARegistry
from minivllm.engine.requests import Choice
from minivllm.engine.runtime.async_engine import (
    AsyncLLMEngine,
    OutputHook,
    RequestStream,
    StepRecorder,
)
from minivllm.lora_request import LoRARequest


class EngineClient(Protocol):
    """What the server needs of an engine: the model's facts, the request stream, the loop's
    lifecycle and its counters."""

    # Set by the server before `start()`: called with each delivered output and its number of
    # new tokens (the metrics), and the waiting-queue bound beyond which adds are refused.
    on_output: OutputHook | None
    max_waiting_requests: int | None

    @property
    def config(self) -> EngineConfig:
        """The engine's resolved options (max_model_len, model, ...)."""
        ...

    @property
    def loras(self) -> LoRARegistry:
        """The named LoRA adapters (`model` names that route to an adapter)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (requests are tokenized on the server's side)."""
        ...

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The model's sampling defaults by SamplingParams' names (generation_config.json)."""
        ...

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (logit_bias and token-id prompts are checked against it)."""
        ...

    @property
    def stats(self) -> dict[str, float]:
        """The engine's stats as of its last step (LLMEngine.stats' names)."""
        ...

    @property
    def is_running(self) -> bool:
        """Whether the engine loop runs (/health)."""
        ...

    def start(self) -> None:
        """Start the engine loop (idempotent)."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop; requests still in flight end with finish_reason "abort"."""
        ...

    def close(self) -> None:
        """Release what the engine holds beyond its loop (worker processes); idempotent."""
        ...

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (ShuttingDownError); those in flight go on."""
        ...

    def abort_all(self) -> None:
        """End every in-flight request now with finish_reason "abort"; safe from any thread."""
        ...

    async def add_request(
        self, request_id: str, choices: list[Choice], lora: LoRARequest | None = None
    ) -> RequestStream:
        """Add one sub-request per choice (under the LoRA adapter `lora`, if given), all or
        none, and return their output stream."""
        ...


def client_for(
    engine: LLMEngine | EngineClient, recorder: StepRecorder | None = None
) -> EngineClient:
    """`engine` as an EngineClient: an LLMEngine of this process is stepped by an
    AsyncLLMEngine thread (with the live lab's `recorder`, if any); a client is itself."""
    if isinstance(engine, LLMEngine):
        return AsyncLLMEngine(engine, recorder=recorder)
    return engine
