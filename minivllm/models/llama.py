"""Llama decoder (also SmolLM2 and other Llama-architecture checkpoints), over a paged KV cache,
and the base every other family here builds on.

Parameter names follow HF's `LlamaForCausalLM` except for the fused projections:
`self_attn.qkv_proj` holds q_proj/k_proj/v_proj and `mlp.gate_up_proj` holds gate_proj/up_proj
(see `packed_modules_mapping`, used by the loader).

A family changes what it must through small hooks: the attention's `biases`, `softmax_scale`,
`logit_softcap` and `norm_qk`; the model's `attention_cls`, `layer_cls`, `norm_cls`, `embed`,
`rotary_for_layers` and `rope_layer_type`; the LM's `model_cls`. Per layer,
`sliding_window_of` reads the window from the config (`sliding_window`, and `layer_types` when
only some layers slide), and `attn_logit_softcapping` / `final_logit_softcapping` cap the
scores and the logits.

Tensor parallelism (`tp_size > 1`, rank `tp_rank`): column-parallel qkv and gate_up,
row-parallel o_proj and down_proj, vocab-parallel embedding and LM head. Each rank keeps the
attention heads of `minivllm.distributed.heads.shard_heads` and the KV heads they read.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minivllm.heap import block_budget
from minivllm.layers.activation import get_gated_activation, soft_cap
from minivllm.layers.attention import Attention, AttentionMetadata
from minivllm.layers.attention.kv_quant import KVCache
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import apply_rotary, get_rope

CosSin = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: Any) -> int:
    """`config.head_dim` when set, else `hidden_size // num_attention_heads` (as HF)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx`, None for full attention: `sliding_window` on
    every layer (Mistral, Phi-3), or on the layers `layer_types` marks "sliding_attention"
    (Gemma 2 and 3, Qwen2 with `use_sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window:
        return None
    if layer_types is None:
        return int(window)
    return int(window) if layer_types[layer_idx] == "sliding_attention" else None


class LlamaMLP(nn.Module):
    """Gated feed-forward: `down(act(gate(x)) * up(x))` with gate and up fused; SiLU (SwiGLU)
    or, from the config, GELU-tanh (Gemma)."""

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.act_fn = get_gated_activation(
            getattr(config, "hidden_activation", None) or config.hidden_act
        )
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        tp: dict[str, Any] = dict(tp_size=tp_size, tp_rank=tp_rank)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=bias, **tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        width = self.gate_up_proj.output_size * x.element_size()  # gate_up's bytes a row
        budget = block_budget()
        if x.device.type != "cpu" or rows * width <= budget:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        # A long prefill's rows a slice at a time: each row's output is the same (a row's
        # matmul does not depend on the others), and no [T, 2 * intermediate] activation
        # larger than the heap serves again is allocated (minivllm/heap.py; docs/performance.md,
        # "Long prefills"). Slices cost: a stored-block weight is dequantized again for each.
        step = max(1, budget // width)
        return torch.cat([self.down_proj(self.act_fn(self.gate_up_proj(p))) for p in x.split(step)])


class LlamaAttention(nn.Module):
    """Self-attention block: fused qkv projection, rotary, paged attention, output projection."""

    def __init__(self, config: Any, layer_idx: int, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        tp: dict[str, Any] = dict(tp_size=tp_size, tp_rank=tp_rank)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias, **tp
        )
        heads = self.qkv_proj.heads  # this rank's query heads and the KV heads they read
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        # o_proj's input is the concatenated heads: this rank's slice follows its heads.
        o_shard = (heads.q_start * self.head_dim, self.num_heads * self.head_dim)
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, bias=o_bias, shard=o_shard, **tp
        )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.softmax_scale(config),
            sliding_window=sliding_window_of(config, layer_idx),
            logit_softcap=self.logit_softcap(config),
        )

    def biases(self, config: Any) -> tuple[bool, bool]:
        """Whether qkv_proj and o_proj have biases: both follow `attention_bias` in Llama."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def logit_softcap(self, config: Any) -> float | None:
        """The cap on attention scores: `attn_logit_softcapping` when the config sets it."""
        return getattr(config, "attn_logit_softcapping", None)

    def softmax_scale(self, config: Any) -> float:
        """The factor on q·k: `head_dim ** -0.5` (Gemma's differs)."""
        return self.head_dim**-0.5

    def split_heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and split into q `[T, H, D]`, k `[T, KVH, D]`, v `[T, KVH, D]`."""
        num_tokens = hidden.shape[0]
        # Viewed whole, then split: a view of a split-off (strided) part made Inductor guard
        # on the number of tokens being 1, so the one-sequence graph missed two-sequence steps.
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, H + 2 * KVH, D]
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)
        return q, k, v  # [T, H, D], [T, KVH, D], [T, KVH, D]

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
        # view, not reshape: v is a view of qkv, and a traced reshape of it specialised the
        # compiled step on its token count being 1 (one graph per step size at start-up).
        out = self.attn(q, k, v.view(num_tokens, -1), kv_cache, meta)  # [T, H * D]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: `h += attn(norm(h)); h += mlp(norm(h))`, carrying the residual separately
    so each norm fuses the preceding add."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attention_cls: type[LlamaAttention],
        norm_cls: type[RMSNorm],
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, tp_size, tp_rank)
        self.mlp = LlamaMLP(config, tp_size, tp_rank)
        self.input_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

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
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def norm_input(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's first norm; the first layer starts the residual stream, later ones add
        the previous layer's output to it."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)


def _call_layer(layer: nn.Module, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(*args)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; returns the last hidden states."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm
    rope_layer_type: str | None = None  # whose rope_parameters, when they are per layer type

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_size, tp_rank
        )
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, self.attention_cls, self.norm_cls, tp_size, tp_rank)
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(config, head_dim_of(config), self.rope_layer_type)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[T]` -> `[T, hidden_size]` (Gemma scales it)."""
        return self.embed_tokens(input_ids)

    def rotary_for_layers(self, positions: torch.Tensor, dtype: torch.dtype) -> list[CosSin]:
        """Each layer's (cos, sin), each `[T, head_dim // 2]`: one rotary for all here."""
        cos_sin = self.rotary_emb(positions, dtype)
        return [cos_sin] * len(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        run_layer: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """`run_layer(layer, hidden, residual, cos, sin, kv_cache, meta)` runs each layer
        (default: calls it); the compiled decode step passes its compiled one."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} kv caches, got {len(kv_caches)}")
        hidden = self.embed(input_ids)  # [T, hidden_size]
        rotary = self.rotary_for_layers(positions, hidden.dtype)
        residual = None
        run_layer = run_layer or _call_layer
        for layer, kv_cache, (cos, sin) in zip(self.layers, kv_caches, rotary, strict=True):
            hidden, residual = run_layer(layer, hidden, residual, cos, sin, kv_cache, meta)
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

    model_cls: type[LlamaModel] = LlamaModel

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
        self.model = self.model_cls(config, tp_size, tp_rank)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size, tp_rank)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden_size]` -> `[N, vocab_size]` float32, soft-capped when configured."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is None:
            return logits
        return soft_cap(logits, self.final_logit_softcap)
