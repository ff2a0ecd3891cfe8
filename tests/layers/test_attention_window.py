"""Sliding-window and soft-capped paged attention against a dense reference.

Guards: a window off by one (HF's `kv_idx > q_idx - window`), a window measured from the chunk
instead of the sequence position, padded query rows left fully masked (NaN), soft-capping
applied after the mask or not at all, the lone-prefill shortcut skipping the window, and a
windowed gather (only the keys a window can see) that misses one.
"""

import random

import pytest
import torch
from support.model_fixtures import make_attention_metadata, shuffled_nan_cache

from minivllm.layers.attention import Attention
from minivllm.layers.attention.metadata import paged_causal_mask
from minivllm.layers.attention.sdpa import store_kv


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One sequence: q `[Q, H, D]` at positions context_len.., k/v `[N, KVH, D]` -> `[Q, H, D]`."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_batch(
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    heads: tuple[int, int],
    window: int | None,
    softcap: float | None,
    seed: int = 0,
) -> None:
    num_heads, num_kv_heads = heads
    head_dim = 8
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables, k_cache, v_cache = shuffled_nan_cache(seq_lens, block_size, num_kv_heads, head_dim, rng)
    full_k = [torch.randn(n, num_kv_heads, head_dim, generator=gen) * 3 for n in seq_lens]
    full_v = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    queries = [torch.randn(n, num_heads, head_dim, generator=gen) * 3 for n in query_lens]
    if any(context_lens):
        prior, _ = make_attention_metadata(tables, [0] * len(tables), context_lens, block_size)
        store_kv(
            torch.cat([k[:c] for k, c in zip(full_k, context_lens, strict=True)]),
            torch.cat([v[:c] for v, c in zip(full_v, context_lens, strict=True)]),
            k_cache,
            v_cache,
            prior.slot_mapping,
        )
    meta, _ = make_attention_metadata(tables, context_lens, query_lens, block_size)
    scale = head_dim**-0.5
    attn = Attention(num_heads, num_kv_heads, head_dim, scale, window, softcap)
    out = attn(
        torch.cat(queries).flatten(1),
        torch.cat([k[c:] for k, c in zip(full_k, context_lens, strict=True)]).flatten(1),
        torch.cat([v[c:] for v, c in zip(full_v, context_lens, strict=True)]).flatten(1),
        (k_cache, v_cache),
        meta,
    )
    expected = torch.cat(
        [
            reference(q, k, v, c, scale, window, softcap)
            for q, k, v, c in zip(queries, full_k, full_v, context_lens, strict=True)
        ]
    ).flatten(1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


BATCHES = {
    "mixed": ([0, 13, 5, 0, 40, 1], [9, 6, 1, 1, 1, 17]),
    "decodes": ([3, 20, 40, 7], [1, 1, 1, 1]),
    "lone-prefill": ([0], [23]),
    "lone-chunk": ([30], [9]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window,softcap", [(4, None), (1, None), (None, 2.0), (5, 1.5)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_window_and_softcap_match_reference(batch, window, softcap, heads) -> None:
    """Each query sees its last `window` keys only; capped scores, in mixed and decode batches
    and in a prefill longer than the window with no context."""
    context_lens, query_lens = BATCHES[batch]
    run_batch(context_lens, query_lens, 4, heads, window, softcap)


def test_window_wider_than_every_sequence_is_plain_causal() -> None:
    """A window no query can outgrow changes nothing (and reuses the causal mask)."""
    run_batch([0, 13, 5], [9, 6, 1], 4, (4, 2), 64, None)


def test_window_mask_never_leaves_a_padded_row_empty() -> None:
    """A decode far into its sequence beside a long prefill: its padded rows sit past every key
    of a narrow window, yet still see key 0 (an empty row would be NaN in SDPA)."""
    query_lens, seq_lens = torch.tensor([1, 8]), torch.tensor([20, 8])
    mask = paged_causal_mask(query_lens, seq_lens, 8, 20, sliding_window=2)
    assert mask.any(-1).all()
    assert mask[0, 0, 0].nonzero().flatten().tolist() == [18, 19]
    assert mask[1, 0, 5].nonzero().flatten().tolist() == [4, 5]


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 2, 8, 1.0, sliding_window=0)


def test_window_gathers_only_the_keys_it_can_see() -> None:
    """Decodes deep into long sequences beside a prefill chunk: a window of 4 gathers
    `4 - 1 + max_query_len` keys per sequence, not the whole sequence, and still matches the
    reference."""
    context_lens, query_lens = [200, 97, 150], [1, 1, 6]
    meta, _ = make_attention_metadata(
        [list(range(i * 60, i * 60 + 60)) for i in range(3)], context_lens, query_lens, 4
    )
    index, mask = meta.kv_view(4)
    assert index.shape == (3, 4 - 1 + 6) and mask.shape == (3, 1, 6, 9)
    assert meta.kv_view(None)[0].shape == (3, 201)
    run_batch(context_lens, query_lens, 4, (4, 2), 4, None)
    run_batch(context_lens, query_lens, 4, (4, 2), 4, 1.5)
