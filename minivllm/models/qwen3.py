"""Qwen3 decoder: the Llama block plus a per-head RMSNorm on q and k before rotary.

Grouped-query attention and tied or untied embeddings come from the config, as for Llama.
"""

from typing import Any

import torch

from minivllm.layers.norm import RMSNorm
from minivllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    """Llama attention with `q_norm`/`k_norm` over each head's `head_dim` features."""

    def __init__(self, config: Any, layer_idx: int, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__(config, layer_idx, tp_size, tp_rank)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over each head's features: q `[T, H, D]`, k `[T, KVH, D]`."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3Model(LlamaModel):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM; same interface and checkpoint-name mapping as `LlamaForCausalLM`."""

    model_cls = Qwen3Model

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=True is not supported")
        super().__init__(config, tp_size, tp_rank)
