"""The layer features the newer families need, against HF's own modules.

Guards: Gemma's `(1 + w)` RMSNorm cast at the wrong point (bf16 drift), the GELU-tanh gate
split the wrong way round, soft-capping, linear and LongRoPE frequencies or LongRoPE's cos/sin
scaling, and a checkpoint with fused qkv / gate_up (Phi-3) loaded into the wrong rows.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

from minivllm.layers.activation import gelu_tanh_and_mul, get_gated_activation, soft_cap
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from minivllm.layers.norm import GemmaRMSNorm
from minivllm.layers.rotary import get_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    """`(1 + w)` applied in float32 before the cast, as HF's Gemma2RMSNorm; the fused residual
    form equals add-then-norm."""
    torch.manual_seed(0)
    ours, hf = GemmaRMSNorm(64, eps=1e-6), Gemma2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.uniform_(-0.5, 0.5)
        ours.weight.copy_(hf.weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x, residual = torch.randn(5, 64, dtype=dtype) * 3, torch.randn(5, 64, dtype=dtype)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, hf(x + residual), rtol=0, atol=0)


def test_gelu_tanh_gate_and_soft_cap() -> None:
    """[gate | up] -> gelu_tanh(gate) * up; soft_cap is cap * tanh(x / cap), bounded by cap."""
    x = torch.randn(3, 32)
    expected = F.gelu(x[:, :16], approximate="tanh") * x[:, 16:]
    torch.testing.assert_close(gelu_tanh_and_mul(x), expected)
    torch.testing.assert_close(get_gated_activation("gelu_pytorch_tanh")(x), expected)
    big = torch.tensor([-1e4, -1.0, 0.0, 0.5, 1e4])
    capped = soft_cap(big, 30.0)
    assert capped.abs().max() <= 30.0
    torch.testing.assert_close(capped, 30.0 * torch.tanh(big / 30.0))
    with pytest.raises(ValueError, match="relu"):
        get_gated_activation("relu")


def phi3_config(**rope: object) -> Phi3Config:
    return Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )


def test_longrope_uses_the_long_factors_and_scales_cos_sin() -> None:
    """A checkpoint extended past its original length: HF's long-sequence frequencies and
    attention factor (sqrt(1 + ln 4 / ln 32) here)."""
    short = [1.0 + 0.1 * i for i in range(8)]
    long = [2.0 + 0.5 * i for i in range(8)]
    config = phi3_config(rope_type="longrope", short_factor=short, long_factor=long)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=100)
    rope = get_rope(config, 16)
    torch.testing.assert_close(rope.inv_freq, hf_inv_freq)
    assert rope.scaling == pytest.approx(hf_factor) and hf_factor > 1.0
    positions = torch.arange(40, 60)
    cos, sin = rope(positions, torch.float32)
    freqs = positions.float()[:, None] * hf_inv_freq[None, :]
    torch.testing.assert_close(cos, freqs.cos() * hf_factor)
    torch.testing.assert_close(sin, freqs.sin() * hf_factor)


def test_linear_rope_divides_the_frequencies() -> None:
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](config)
    torch.testing.assert_close(get_rope(config, 16).inv_freq, hf_inv_freq)


def test_fused_checkpoint_tensors_load_like_their_parts() -> None:
    """A checkpoint's fused [q | k | v] and [gate | up] load into the same rows as the three
    (two) separate tensors would, on every tensor-parallel rank."""
    hidden, head_dim, heads, kv_heads = 8, 4, 4, 2
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(kv_heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden)
    gate, up = torch.randn(12, hidden), torch.randn(12, hidden)
    for tp_size in (1, 2):
        for rank in range(tp_size):
            fused, parts = (
                QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, tp_size, rank)
                for _ in range(2)
            )
            fused.weight_loader(fused.weight, torch.cat([q, k, v]))
            for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
                parts.weight_loader(parts.weight, tensor, shard_id)
            assert torch.equal(fused.weight, parts.weight)
            mlp_fused, mlp_parts = (
                MergedColumnParallelLinear(hidden, [12, 12], False, tp_size, rank) for _ in range(2)
            )
            mlp_fused.weight_loader(mlp_fused.weight, torch.cat([gate, up]))
            mlp_parts.weight_loader(mlp_parts.weight, gate, 0)
            mlp_parts.weight_loader(mlp_parts.weight, up, 1)
            assert torch.equal(mlp_fused.weight, mlp_parts.weight)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused.weight_loader(fused.weight, torch.cat([q, k]))
