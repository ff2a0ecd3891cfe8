"""A request's LoRA adapter, vLLM's `LoRARequest` shape.

`lora_name` names the adapter (the server's `model` field routes to it), `lora_int_id` is its
number (positive, unique per adapter: it keys the prefix cache and the runner's slots) and
`lora_path` is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) or a
llama.cpp LoRA `.gguf`. Pure Python: the engine core carries only the id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        lid = self.lora_int_id
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {lid!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
