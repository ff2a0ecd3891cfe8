"""Qwen2 / Qwen2.5 decoder: the Llama block with biases on q, k and v (none on o_proj).

A sliding window, when `use_sliding_window` is set, covers the layers HF's `layer_types`
marks (those from `max_window_layers` on).
"""

from typing import Any

from minivllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    def biases(self, config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2Model(LlamaModel):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM; same interface and checkpoint-name mapping as `LlamaForCausalLM`."""

    model_cls = Qwen2Model
