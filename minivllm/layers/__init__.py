"""Building blocks of the decoder models: norms, rotary, activations, linears, attention."""

from minivllm.layers.activation import SiluAndMul, silu_and_mul
from minivllm.layers.attention import Attention, AttentionMetadata
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding, apply_rotary, get_rope

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "apply_rotary",
    "get_rope",
    "silu_and_mul",
]
