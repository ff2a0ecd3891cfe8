"""The typed messages between the HTTP process and the engine process (engine_process.py,
engine_core.py), pickled over one socket pair."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.requests import Choice
from minivllm.lora_request import LoRARequest
from minivllm.outputs import RequestOutput

# ---- messages to the engine process -------------------------------------------------------


@dataclass
class EngineStart:
    engine_options: dict[str, Any]
    max_waiting_requests: int | None
    log_level: int = logging.WARNING  # the HTTP process's (`minivllm -v serve`: INFO)


@dataclass
class AddRequest:
    request_id: str
    choices: list[Choice]
    # the LoRA adapter they run under (None: the base model), resolved by the server's registry,
    # so an adapter named at run time needs no message of its own
    lora: LoRARequest | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class AbortAllRequests:
    pass


@dataclass
class StopAccepting:
    pass


@dataclass
class SetWaitingLimit:
    limit: int | None


@dataclass
class Shutdown:
    pass


# ---- messages from it ---------------------------------------------------------------------


@dataclass
class EngineResolved:
    """The model's directory (a GGUF's converted config and tokenizer), sent as soon as it is
    known: the HTTP side loads the tokenizer from it while the engine loads and compiles,
    instead of receiving it pickled at the end (2 s of a 262k-token vocabulary, in series)."""

    model_dir: str


@dataclass
class EngineReady:
    config: EngineConfig
    default_sampling_params: dict[str, Any]
    vocab_size: int


@dataclass
class EngineFailed:
    error: str
    # a bad input (model path, file, option), raised again as is on the HTTP side: the CLI
    # then prints its one line and exits 2, as when the engine is built in-process
    bad_input: Exception | None = None


@dataclass
class RequestAdded:
    request_id: str
    error: Exception | None  # why the add was refused (raised again on this side)


@dataclass
class StepOutputs:
    outputs: list[tuple[str, int, RequestOutput, int]]  # (request_id, index, output, new tokens)
    stats: dict[str, float]
    num_steps: int
    num_loop_errors: int
