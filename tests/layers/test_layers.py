"""Layer maths against HF's own modules or a naive reference.

Guards: RMSNorm/rotary/SiluAndMul drifting from HF (wrong logits everywhere), rope scaling read
from the config the wrong way, and paged attention attending to the wrong tokens (wrong
slots, wrong causal offset for chunked prefill, GQA head mapping, padding leaking through).
"""

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from support.model_fixtures import make_attention_metadata
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention
from minivllm.layers.attention.metadata import paged_causal_mask, paged_kv_gather_index
from minivllm.layers.attention.partition import MAX_GROUPS, partition_batch
from minivllm.layers.attention.sdpa import paged_attention_sdpa, store_kv
from minivllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import apply_rotary, get_rope, rope_parameters_from_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# ---------------------------------------------------------------- norm, activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    """RMSNorm equals HF's LlamaRMSNorm, and the fused-residual form equals add-then-norm."""
    torch.manual_seed(0)
    ours, hf = RMSNorm(64, eps=1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(hf.weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = torch.randn(7, 64, dtype=dtype)
    residual = torch.randn(7, 64, dtype=dtype)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, hf(x + residual), rtol=0, atol=0)


def test_silu_and_mul_matches_formula() -> None:
    """SiluAndMul splits [gate | up] in that order."""
    x = torch.randn(5, 2 * 24)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :24]) * x[:, 24:])


# ---------------------------------------------------------------- rotary


def _hf_rotary(config: LlamaConfig, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    """HF's rotary on `[T, heads, D]` tensors at `positions`."""
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # each [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )  # each [1, heads, T, D]
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rotary_matches_hf(rope: dict | None) -> None:
    """Rotary (default and llama3-scaled) equals HF's rotary embedding + apply_rotary_pos_emb."""
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters=rope,
    )
    rotary = get_rope(config, head_dim=16)
    expected_inv_freq = (
        ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]
        if rope
        else 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2) / 16))
    )
    torch.testing.assert_close(rotary.inv_freq, expected_inv_freq.float())

    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 5, 63, 64, 100, 300, 511])
    q = torch.randn(len(positions), 4, 16)
    k = torch.randn(len(positions), 2, 16)
    cos, sin = rotary(positions, torch.float32)
    q_hf, k_hf = _hf_rotary(config, q, k, positions)
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_hf, rtol=1e-6, atol=1e-6)


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    """llama3 scaling keeps the highest frequency and divides the lowest by `factor`."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    plain = get_rope(config, 16).inv_freq
    scaled_config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=LLAMA3_ROPE
    )
    scaled = get_rope(scaled_config, 16).inv_freq
    theta_plain = get_rope(LlamaConfig(head_dim=16, rope_theta=500000.0), 16).inv_freq
    assert not torch.equal(plain, scaled)
    torch.testing.assert_close(scaled[0], theta_plain[0])
    torch.testing.assert_close(scaled[-1], theta_plain[-1] / 8.0)


def test_rope_parameters_read_like_transformers() -> None:
    """5.x `rope_parameters`, and legacy `rope_theta` + `rope_scaling` with a `type` key."""
    new = LlamaConfig(rope_parameters=dict(LLAMA3_ROPE))
    assert rope_parameters_from_config(new)["rope_type"] == "llama3"
    legacy = SimpleNamespace(
        rope_theta=1234.0,
        rope_scaling={
            "type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        max_position_embeddings=99,
    )
    params = rope_parameters_from_config(legacy)
    assert params["rope_type"] == "llama3"
    assert params["rope_theta"] == 1234.0
    assert params["original_max_position_embeddings"] == 99
    plain = rope_parameters_from_config(SimpleNamespace(max_position_embeddings=8))
    assert plain == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="yarn"):
        get_rope(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), 16)


def test_rotary_inv_freq_stays_float32_when_model_is_cast() -> None:
    """Casting the model to bf16 must not round the rotary frequencies (HF keeps them fp32)."""
    rotary = get_rope(LlamaConfig(head_dim=16), 16).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32


# ---------------------------------------------------------------- linear weight loaders


def test_qkv_and_gate_up_shards_land_in_place() -> None:
    """Fused projections compute exactly what their separate checkpoint matrices would."""
    torch.manual_seed(0)
    qkv = QKVParallelLinear(32, head_dim=8, num_heads=4, num_kv_heads=2, bias=True)
    parts = {"q": torch.randn(32, 32), "k": torch.randn(16, 32), "v": torch.randn(16, 32)}
    biases = {"q": torch.randn(32), "k": torch.randn(16), "v": torch.randn(16)}
    for shard, weight in parts.items():
        qkv.weight.weight_loader(qkv.weight, weight, shard)
        qkv.bias.weight_loader(qkv.bias, biases[shard], shard)
    x = torch.randn(3, 32)
    expected = torch.cat([F.linear(x, parts[s], biases[s]) for s in "qkv"], dim=-1)
    torch.testing.assert_close(qkv(x), expected)

    gate_up = MergedColumnParallelLinear(32, [48, 48])
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    torch.testing.assert_close(gate_up(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    with pytest.raises(ValueError, match="shape mismatch"):
        gate_up.weight.weight_loader(gate_up.weight, torch.randn(47, 32), 0)


def test_weight_loaders_take_this_ranks_slice() -> None:
    """Column-parallel keeps its rows of every shard, row-parallel its input columns."""
    full = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
    merged = MergedColumnParallelLinear(4, [8, 8], tp_size=2, tp_rank=1)
    merged.weight.weight_loader(merged.weight, full, 0)
    merged.weight.weight_loader(merged.weight, full + 100, 1)
    torch.testing.assert_close(merged.weight.data, torch.cat([full[4:], full[4:] + 100]))
    row = RowParallelLinear(4, 8, tp_size=2, tp_rank=0)
    row.weight.weight_loader(row.weight, full)
    torch.testing.assert_close(row.weight.data, full[:, :2])
    qkv = QKVParallelLinear(4, head_dim=2, num_heads=2, num_kv_heads=2, tp_size=2, tp_rank=1)
    qkv.weight.weight_loader(qkv.weight, full[:4], "q")
    torch.testing.assert_close(qkv.weight.data[:2], full[2:4])


# ---------------------------------------------------------------- paged attention


def test_gather_index_and_mask_small_example() -> None:
    """Block table [2, 0] with block_size 2: positions 0..3 live in slots 4, 5, 0, 1; padding is
    clamped to the last token; a 2-token chunk after 1 cached token sees keys 0..1 and 0..2."""
    tables = torch.tensor([[2, 0], [1, 0]])
    seq_lens = torch.tensor([3, 1])
    index = paged_kv_gather_index(tables, seq_lens, max_seq_len=4, block_size=2)
    assert index.tolist() == [[4, 5, 0, 0], [2, 2, 2, 2]]
    mask = paged_causal_mask(torch.tensor([2, 1]), seq_lens, max_query_len=2, max_seq_len=3)
    assert mask.shape == (2, 1, 2, 3)
    assert mask[0, 0].tolist() == [[True, True, False], [True, True, True]]
    assert mask[1, 0, 0].tolist() == [True, False, False]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Naive causal attention of one sequence: q `[q_len, H, D]` at positions
    `context_len..`, over its full k/v `[seq_len, KVH, D]`. Returns `[q_len, H, D]`."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [seq_len, H, D]
    v = v.repeat_interleave(group, dim=1)  # [seq_len, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, seq_len]
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    visible = torch.arange(k.shape[0])[None, :] <= q_pos  # [q_len, seq_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 8,
    seed: int = 0,
) -> None:
    """Build a random paged batch, run `Attention`, compare each sequence with the reference."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # a few spare blocks nobody owns
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere not written: reading an unwritten slot would poison the output.
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))

    full_k = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    full_v = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    queries = [torch.randn(n, num_heads, head_dim, generator=gen) for n in query_lens]
    # Earlier steps cached the context tokens.
    prior, _ = make_attention_metadata(tables, [0] * len(tables), context_lens, block_size)
    store_kv(
        torch.cat([k[:c] for k, c in zip(full_k, context_lens, strict=True)]),
        torch.cat([v[:c] for v, c in zip(full_v, context_lens, strict=True)]),
        k_cache,
        v_cache,
        prior.slot_mapping,
    )

    meta, _ = make_attention_metadata(tables, context_lens, query_lens, block_size)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, context_lens, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, context_lens, strict=True)])
    scale = head_dim**-0.5
    attn = Attention(num_heads, num_kv_heads, head_dim, scale)
    out = attn(
        torch.cat(queries).flatten(1),
        new_k.flatten(1),
        new_v.flatten(1),
        (k_cache, v_cache),
        meta,
    )  # [T, H * D]
    assert out.shape == (sum(query_lens), num_heads * head_dim)
    expected = torch.cat(
        [
            reference_attention(q, k, v, c, scale)
            for q, k, v, c in zip(queries, full_k, full_v, context_lens, strict=True)
        ]
    ).flatten(1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The new K/V are in the cache at their slots.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[meta.slot_mapping], new_k, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "mqa"])
def test_paged_attention_mixed_batch(block_size: int, heads: tuple[int, int]) -> None:
    """Prefills without context, prefill chunks after cached context, and decodes in one batch."""
    num_heads, num_kv_heads = heads
    context_lens = [0, 13, 5, 0, 40, 1]
    query_lens = [9, 6, 1, 1, 1, 17]
    run_paged_batch(context_lens, query_lens, block_size, num_heads, num_kv_heads, seed=block_size)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_decode_only(block_size: int) -> None:
    """The all-decode fast path (no query padding) with uneven sequence lengths."""
    context_lens = [0, 3, 31, 16, 7]
    run_paged_batch(context_lens, [1] * len(context_lens), block_size, 4, 2, seed=7)


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_random_batches(seed: int) -> None:
    """Random mixes of sequence counts, context lengths, chunk sizes and block sizes."""
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 8)
    context_lens = [rng.choice([0, rng.randint(1, 50)]) for _ in range(num_seqs)]
    query_lens = [rng.choice([1, rng.randint(1, 20)]) for _ in range(num_seqs)]
    block_size = rng.choice([1, 4, 16])
    run_paged_batch(context_lens, query_lens, block_size, 4, 2, seed=seed)


@pytest.mark.parametrize("seed", range(3))
def test_paged_attention_split_into_many_groups(seed: int) -> None:
    """Decodes with widely spread lengths beside prefill chunks: the batch runs as several
    groups (checked), and every sequence still gets the reference answer."""
    rng = random.Random(seed)
    context_lens = [rng.choice([1, 5, 30, 90, 200]) + rng.randint(0, 3) for _ in range(14)]
    query_lens = [1] * 10 + [rng.randint(2, 40) for _ in range(4)]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    assert len(partition_batch(query_lens, seq_lens)) > 2
    run_paged_batch(context_lens, query_lens, 4, 4, 2, seed=seed)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 300), st.sampled_from([1, 1, 1, 2, 7, 64])),
        min_size=1,
        max_size=40,
    )
)
def test_partition_batch_properties(seqs: list[tuple[int, int]]) -> None:
    """Every sequence in exactly one group; a group never mixes decodes with prefills; at most
    MAX_GROUPS groups; the padded work never exceeds the unsplit batch's."""
    query_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    groups = partition_batch(query_lens, seq_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    assert all(g for g in groups) and len(groups) <= MAX_GROUPS
    for g in groups:
        assert len({query_lens[i] == 1 for i in g}) == 1

    def work(g: list[int]) -> int:
        return len(g) * max(query_lens[i] for i in g) * max(seq_lens[i] for i in g)

    assert sum(work(g) for g in groups) <= work(list(range(len(seqs))))


def test_single_sequence_sdpa_matches_plain_causal_attention() -> None:
    """A lone prefill with no context is ordinary causal attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 4, 8), torch.randn(10, 4, 8)
    k_cache, v_cache = torch.zeros(3, 4, 4, 8), torch.zeros(3, 4, 4, 8)
    meta, _ = make_attention_metadata([[2, 0, 1]], [0], [10], block_size=4)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention_sdpa(q, k_cache, v_cache, meta, scale=8**-0.5)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_attention_rejects_bad_head_counts() -> None:
    """num_heads must be a multiple of num_kv_heads."""
    with pytest.raises(ValueError, match="multiple"):
        Attention(6, 4, 8, 1.0)


@pytest.mark.parametrize("block_size", [1, 16])
def test_lone_prefill_fast_path(block_size: int) -> None:
    """One sequence with no cached context takes the no-gather causal path; same answer."""
    run_paged_batch([0], [21], block_size, 4, 2, seed=3)
