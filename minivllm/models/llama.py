"""Llama decoder (also SmolLM2 and other Llama-architecture checkpoints), over a paged KV cache.

Parameter names follow HF's `LlamaForCausalLM` except for the fused projections:
`self_attn.qkv_proj` holds q_proj/k_proj/v_proj and `mlp.gate_up_proj` holds gate_proj/up_proj
(see `packed_modules_mapping`, used by the loader).

Tensor parallelism (`tp_size > 1`, rank `tp_rank`): column-parallel qkv and gate_up,
row-parallel o_proj and down_proj, vocab-parallel embedding and LM head. Each rank keeps the
attention heads of `minivllm.distributed.heads.shard_heads` and the KV heads they read.
"""

from typing import Any

import torch
from torch import nn

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention, AttentionMetadata
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import apply_rotary, get_rope

KVCache = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: Any) -> int:
    """`config.head_dim` when set, else `hidden_size // num_attention_heads` (as HF)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` with gate and up fused."""

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        tp = dict(tp_size=tp_size, tp_rank=tp_rank)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=bias, **tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, **tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention block: fused qkv projection, rotary, paged attention, output projection."""

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        tp = dict(tp_size=tp_size, tp_rank=tp_rank)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=bias, **tp
        )
        heads = self.qkv_proj.heads  # this rank's query heads and the KV heads they read
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        # o_proj's input is the concatenated heads: this rank's slice follows its heads.
        o_shard = (heads.q_start * self.head_dim, self.num_heads * self.head_dim)
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, bias=bias, shard=o_shard, **tp
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )

    def split_heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and split into q `[T, H, D]`, k `[T, KVH, D]`, v `[T, KVH, D]`."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        q, k, v = qkv.split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1
        )
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        return q, k, v

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation of q and k before rotary: none in Llama (Qwen3 has one)."""
        return q, k

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.split_heads(hidden)
        q, k = self.norm_qk(q, k)
        q = apply_rotary(q, cos, sin).view(num_tokens, -1)  # [T, H * D]
        k = apply_rotary(k, cos, sin).view(num_tokens, -1)  # [T, KVH * D]
        out = self.attn(q, k, v.reshape(num_tokens, -1), kv_cache, meta)  # [T, H * D]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: `h += attn(norm(h)); h += mlp(norm(h))`, carrying the residual separately
    so each norm fuses the preceding add."""

    def __init__(
        self, config: Any, attention_cls: type[LlamaAttention], tp_size: int = 1, tp_rank: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, tp_size, tp_rank)
        self.mlp = LlamaMLP(config, tp_size, tp_rank)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; returns the last hidden states."""

    def __init__(
        self, config: Any, attention_cls: type[LlamaAttention], tp_size: int = 1, tp_rank: int = 0
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_size, tp_rank
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls, tp_size, tp_rank)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(config, head_dim_of(config))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} kv caches, got {len(kv_caches)}")
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # each [T, head_dim // 2]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache.

    `forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]`, where
    `kv_caches[i] = (k_cache, v_cache)` of layer `i`, each
    `[num_blocks, block_size, num_key_value_heads, head_dim]` in the model dtype.
    `compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]` float32 (on rank 0 when
    tensor-parallel). With `tp_size > 1`, the KV caches hold this rank's KV heads only.
    """

    attention_cls: type[LlamaAttention] = LlamaAttention

    # checkpoint module name -> (fused module name, shard id); read by the loader.
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls, tp_size, tp_rank)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size, tp_rank)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden_size]` -> `[N, vocab_size]` float32."""
        return self.lm_head(hidden)
