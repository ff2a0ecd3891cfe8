"""Gemma 3 text decoder (`Gemma3ForCausalLM`, the 1B and the text part of the others): Gemma 2's
block with per-head `(1 + w)` q/k norms, no attention soft-capping, and two rotary
embeddings: the local base (`rope_parameters["sliding_attention"]`, 10k) on the sliding-window
layers and the global one (`["full_attention"]`, 1M, linearly scaled in the larger models) on
the full-attention layers, which `layer_types` places every sixth layer.
"""

from typing import Any

import torch

from minivllm.layers.norm import GemmaRMSNorm
from minivllm.layers.rotary import get_rope
from minivllm.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM, Gemma2Model
from minivllm.models.llama import CosSin, head_dim_of

LOCAL, GLOBAL = "sliding_attention", "full_attention"


class Gemma3Attention(Gemma2Attention):
    """Gemma 2 attention with `q_norm`/`k_norm` over each head's features, before rotary."""

    def __init__(self, config: Any, layer_idx: int, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__(config, layer_idx, tp_size, tp_rank)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def logit_softcap(self, config: Any) -> float | None:
        """None: Gemma 3 dropped attention soft-capping (HF ignores the config field)."""
        return None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, H, D]`, k `[T, KVH, D]`, normed per head."""
        return self.q_norm(q), self.k_norm(k)


class Gemma3Model(Gemma2Model):
    attention_cls = Gemma3Attention
    rope_layer_type = GLOBAL  # self.rotary_emb; the local one is rotary_emb_local

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__(config, tp_size, tp_rank)
        self.rotary_emb_local = get_rope(config, head_dim_of(config), LOCAL)
        self.layer_types = list(config.layer_types)

    def rotary_for_layers(self, positions: torch.Tensor, dtype: torch.dtype) -> list[CosSin]:
        rotary = {
            GLOBAL: self.rotary_emb(positions, dtype),
            LOCAL: self.rotary_emb_local(positions, dtype),
        }
        return [rotary[kind] for kind in self.layer_types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM; same interface and checkpoint-name mapping as Llama's."""

    model_cls = Gemma3Model

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True is not supported")
        super().__init__(config, tp_size, tp_rank)
