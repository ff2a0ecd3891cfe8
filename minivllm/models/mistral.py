"""Mistral decoder: the Llama block with a sliding window (`config.sliding_window`) on every
layer; `sliding_window: null` (Mistral v0.2 and later) is full attention."""

from minivllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM: `LlamaForCausalLM`, whose attention reads the window per layer."""
