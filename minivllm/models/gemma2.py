"""Gemma 2 decoder: the Llama block with Gemma's changes.

- `(1 + w)` RMSNorm (`GemmaRMSNorm`), GELU-tanh gated MLP (`hidden_activation`);
- sandwich norms: each sub-block's output is normed before it joins the residual stream
  (`post_attention_layernorm`, `post_feedforward_layernorm`), besides the pre-norms;
- embeddings scaled by `sqrt(hidden_size)` (rounded to the model dtype, as HF);
- q·k scaled by `query_pre_attn_scalar ** -0.5`; attention scores and final logits soft-capped
  (`attn_logit_softcapping`, `final_logit_softcapping`, read by the shared layers);
- a sliding window on the layers `layer_types` marks "sliding_attention" (every other one).
"""

from typing import Any

import torch

from minivllm.layers.attention import AttentionMetadata
from minivllm.layers.norm import GemmaRMSNorm, RMSNorm
from minivllm.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Gemma2Attention(LlamaAttention):
    def softmax_scale(self, config: Any) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5


class SandwichDecoderLayer(LlamaDecoderLayer):
    """`h += post_norm(attn(pre_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))`, the residual
    carried separately as in the Llama layer (the next pre-norm fuses the add)."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attention_cls: type[LlamaAttention],
        norm_cls: type[RMSNorm],
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__(config, layer_idx, attention_cls, norm_cls, tp_size, tp_rank)
        self.pre_feedforward_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm_input(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(LlamaModel):
    attention_cls = Gemma2Attention
    layer_cls = SandwichDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        # HF rounds the normaliser to the model dtype first (sqrt(3072) is 55.5 in bf16).
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM; same interface and checkpoint-name mapping as `LlamaForCausalLM`."""

    model_cls = Gemma2Model
