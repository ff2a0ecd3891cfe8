"""Phi-3 / Phi-3.5 decoder: the Llama block, with q/k/v and gate/up already fused in the
checkpoint (`qkv_proj`, `gate_up_proj`: loaded whole and split by the fused layers' weight
loaders), a sliding window on every layer when `sliding_window` is set, and LongRoPE scaling
when configured (`minivllm.layers.rotary`)."""

from typing import Any

from minivllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM: `LlamaForCausalLM` with the checkpoint's own fused names."""

    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
            raise ValueError("Phi-3 with partial_rotary_factor != 1 is not supported")
        super().__init__(config, tp_size, tp_rank)
