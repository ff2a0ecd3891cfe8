"""Rotary position embedding (RoPE), neox/HF layout: "default", "linear", "llama3" and
"longrope" (Phi-3) frequencies.

The RoPE settings are read from the HF config the way transformers 5.x stores them:
`config.rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}`, or one such
dict per layer type (Gemma 3: `{"sliding_attention": {...}, "full_attention": {...}}`). Older
configs that carry `rope_theta` and `rope_scaling` (with `type` or `rope_type`) separately are
accepted too.

LongRoPE has two sets of factors, HF picking the long one whenever the sequence at hand is
longer than `original_max_position_embeddings`. Over a paged cache the choice must hold for a
sequence's whole life, so it is made once: the long factors when the checkpoint's
`max_position_embeddings` exceeds the original length (its reason to exist), as llama.cpp does
at such context sizes. HF agrees on every sequence longer than the original length.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters_from_config(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Return one flat RoPE parameter dict with at least `rope_type` and `rope_theta`: the
    config's, or for per-layer-type parameters those of `layer_type`."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError("per-layer-type rope_parameters need the layer type")
    params.setdefault("rope_type", params.pop("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "longrope"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        params.setdefault(
            "original_max_position_embeddings", original or hf_config.max_position_embeddings
        )
        params.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    return params


def default_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    """Inverse frequencies `theta ** (-2i / head_dim)`; returns `[head_dim // 2]` float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (rope_theta**exponents)


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1 frequency scaling: keep high frequencies, divide low ones by `factor`,
    and interpolate smoothly in between (transformers' `_compute_llama3_parameters`).
    """
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, rope_params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32 for a flat RoPE parameter dict."""
    rope_type = rope_params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    inv_freq = default_inv_freq(head_dim, float(rope_params["rope_theta"]))
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_params["factor"])
    elif rope_type == "longrope":
        factors = rope_params["long_factor" if uses_long_factors(rope_params) else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope needs {head_dim // 2} factors, got {len(factors)}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(
            inv_freq,
            factor=rope_params["factor"],
            low_freq_factor=rope_params["low_freq_factor"],
            high_freq_factor=rope_params["high_freq_factor"],
            original_max_position_embeddings=rope_params["original_max_position_embeddings"],
        )
    return inv_freq


def uses_long_factors(rope_params: dict[str, Any]) -> bool:
    """LongRoPE: the long factors when the checkpoint extends its original context (see the
    module docstring)."""
    return rope_params["max_position_embeddings"] > rope_params["original_max_position_embeddings"]


def attention_factor(rope_params: dict[str, Any]) -> float:
    """The factor cos and sin are scaled by: 1 but for LongRoPE, where it is
    `sqrt(1 + ln(factor) / ln(original length))` unless the config gives it."""
    if rope_params["rope_type"] != "longrope":
        return 1.0
    if rope_params.get("attention_factor") is not None:
        return float(rope_params["attention_factor"])
    original = rope_params["original_max_position_embeddings"]
    factor = rope_params.get("factor") or rope_params["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `position * inv_freq` (times `scaling`), each `[num_tokens, head_dim // 2]`
    in `dtype`.

    Computed in float32 from the positions (no table), exactly as HF does, then cast.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    if scaling == 1.0:
        return freqs.cos().to(dtype), freqs.sin().to(dtype)
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[num_tokens, num_heads, head_dim]` by per-token angles (neox "rotate_half").

    `cos`/`sin` are `[num_tokens, head_dim // 2]`; the first and second halves of each head
    form the (real, imaginary) pairs, as in HF's `apply_rotary_pos_emb`.
    """
    cos = cos.unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
    sin = sin.unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
    x1, x2 = x.chunk(2, dim=-1)  # each [num_tokens, num_heads, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; `forward(positions, dtype)` gives the step's (cos, sin).

    The model calls it once per step and hands (cos, sin) to every layer, which applies them
    with `apply_rotary`.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, rope_params: dict[str, Any]) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.rope_type = rope_params["rope_type"]
        self.scaling = attention_factor(rope_params)
        # Not persistent: it is derived from the config, never loaded from a checkpoint.
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, rope_params), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self.inv_freq, dtype, self.scaling)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # `model.to(torch.bfloat16)` would round the frequencies; keep them float32 (as HF
        # does) and follow only the device change.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope_type={self.rope_type}"


def get_rope(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """Build the rotary embedding described by an HF config (for `layer_type`'s layers when
    the config has per-layer-type parameters)."""
    return RotaryEmbedding(head_dim, rope_parameters_from_config(hf_config, layer_type))
