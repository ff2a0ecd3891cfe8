"""The Triton kernel of paged attention: every query of a step over the paged KV cache, read
through the block tables (no gathered copy).

One program attends one tile of a sequence's new tokens for one KV head, optionally over one
split of its keys:

- the tile's rows are (query token, query head) pairs: `BLOCK_Q` consecutive new tokens times
  the `GROUP` query heads that share the KV head (GQA/MQA), so each K/V tile is loaded once for
  the whole group (rows padded to `BLOCK_M`, a power of two, at least 16 for `tl.dot`);
- keys are visited `BLOCK_N` positions at a time, each position's block looked up in the
  sequence's block table; online softmax (running max and sum) in fp32;
- a query at position `p` sees keys `0..p` (causal within the new tokens, all of the cached
  context), or with `window` only keys `p - window + 1 .. p`; scores are soft-capped
  (`cap * tanh(s / cap)`) before the mask when `USE_SOFTCAP`;
- with `NUM_SPLITS > 1` (decode and verify steps over long contexts: flash-decoding) each
  program covers one contiguous share of the keys and writes its unnormalised output, running
  max and sum; `reduce_splits` in `triton_attention.py` combines them.

The head dimension is padded to `HEAD_DIM_PAD` (a power of two) and masked: head sizes like
80 or 96 need no special kernel.

A quantized cache is read as stored (`KV_QUANT`): int8 codes with a float32 scale per slot and
KV head (the key's scale multiplies its column of scores, the value's its row of the tile), or
fp8 e4m3 bytes widened in registers by placing their bits in a float16 (exact, subnormals
included, on any GPU and under the interpreter alike). `KV_QUANT`: 0 as computed, 1 int8,
2 fp8 (`triton_attention.KV_QUANT`).
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tl has no portable tanh (libdevice is CUDA-only, not in the interpreter); this form
    # saturates to +-1 without overflow: exp(2x) -> inf gives 1, -> 0 gives -1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_rows(ptrs, mask, dtype, KV_QUANT: tl.constexpr):
    """A K or V tile as `dtype`; fp8 bytes as their e4m3 values (int8 codes as themselves)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if KV_QUANT == 2:
        # e4m3's sign, 4 exponent and 3 mantissa bits placed as a float16's (bias 15, not 7):
        # the float16 reads the value / 2^8, normals and subnormals alike.
        x = x.to(tl.uint16)
        x = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    return x.to(dtype)


@triton.jit
def _key_range(
    context_len,
    seq_len,
    q_tile,
    split,
    window,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """`[begin, end)`: the positions any row of this tile sees (up to its last token, from its
    first token's window), or with splits this program's share of them in whole key tiles."""
    end = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
    begin = end * 0
    if USE_WINDOW:
        begin = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS > 1:
        span = tl.cdiv(tl.cdiv(end - begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        begin = begin + split * span
        end = tl.minimum(end, begin + span)
    return begin, end


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    # fp32 models must not drop to tf32 (the token-exact path); halves ignore the choice.
    if IEEE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_keys(q, q_pos, k_base, v_base, ks_base, vs_base, table_ptr, begin, end, scale,
                 softcap, window, dims, dim_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, USE_WINDOW: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr,
                 KV_QUANT: tl.constexpr):  # fmt: skip
    """Online softmax of the rows `q` `[M, D_PAD]` over keys `begin..end` of one KV head
    (`k_base`/`v_base` point at its first element, a cache slot is `ROW` elements; an int8
    cache's scales at `ks_base`/`vs_base`, `NUM_KV_HEADS` a slot): the running max and sum
    `[M]` and the unnormalised output `[M, D_PAD]`, fp32."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(begin, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [N]: positions
        key_ok = keys < end
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        index = block * BLOCK_SIZE + keys % BLOCK_SIZE  # [N]: the cache slots
        slot = index * ROW  # [N]
        k = _load_rows(
            k_base + slot[None, :] + dims[:, None],
            key_ok[None, :] & dim_ok[:, None],
            q.dtype,
            KV_QUANT,
        )  # [D_PAD, N]
        s = _dot(q, k, IEEE_DOT) * scale  # [M, N]
        if KV_QUANT == 1:  # q . (codes * s_k) = (q . codes) * s_k
            s = s * tl.load(ks_base + index * NUM_KV_HEADS, mask=key_ok, other=0.0)[None, :]
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        seen = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps -inf: subtract 0 so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])  # [M, N]
        alpha = tl.exp(m_i - m_safe)  # [M]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(
            v_base + slot[:, None] + dims[None, :],
            key_ok[:, None] & dim_ok[None, :],
            q.dtype,
            KV_QUANT,
        )  # [N, D_PAD]
        if KV_QUANT == 1:
            v_scale = tl.load(vs_base + index * NUM_KV_HEADS, mask=key_ok, other=0.0)  # [N]
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_output(out_ptr, max_ptr, sum_ptr, row, row_ok, split, m_i, l_i, acc, dims, dim_ok,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  NUM_SPLITS: tl.constexpr):  # fmt: skip
    """The rows' normalised output, or with splits this split's partial output and stats."""
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        stat = row * NUM_SPLITS + split  # [M]: (token, head, split)
        tl.store(out_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(max_ptr + stat, m_i, mask=row_ok)
        tl.store(sum_ptr + stat, l_i, mask=row_ok)


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [T, H, D] (NUM_SPLITS == 1) or fp32 [T, H, NUM_SPLITS, D_PAD]
    max_ptr,  # fp32 [T, H, NUM_SPLITS]: each split's running max (splits only)
    sum_ptr,  # fp32 [T, H, NUM_SPLITS]: each split's running sum (splits only)
    q_ptr,  # [T, H, D], contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D], contiguous
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D], contiguous (fp8: its bytes)
    k_scale_ptr,  # fp32 [num_blocks, BLOCK_SIZE, KVH]: int8 only (else any pointer, unread)
    v_scale_ptr,
    block_tables_ptr,  # [S, max_blocks], contiguous
    seq_lens_ptr,  # [S]: tokens in the cache after this step
    query_start_loc_ptr,  # [S + 1]
    scale, softcap, window, max_blocks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid covers the step's longest query run
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # [M]: the row's new token, within the sequence
    head = kv_head * GROUP + rows % GROUP  # [M]: its query head
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row = (q_start + q_idx).to(tl.int64) * (NUM_KV_HEADS * GROUP) + head  # [M]: (token, head)
    # fmt: off
    q = tl.load(q_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, D_PAD]
    begin, end = _key_range(context_len, seq_len, q_tile, split, window, BLOCK_Q, BLOCK_N,
                            NUM_SPLITS, USE_WINDOW)
    m_i, l_i, acc = _attend_keys(
        q, context_len + q_idx, k_cache_ptr + kv_head * HEAD_DIM, v_cache_ptr + kv_head * HEAD_DIM,
        k_scale_ptr + kv_head, v_scale_ptr + kv_head, block_tables_ptr + seq * max_blocks, begin,
        end, scale, softcap, window, dims, dim_ok, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, BLOCK_SIZE,
        NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS, USE_WINDOW, USE_SOFTCAP, IEEE_DOT, KV_QUANT,
    )
    _store_output(out_ptr, max_ptr, sum_ptr, row, row_ok, split, m_i, l_i, acc, dims, dim_ok,
                  HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS)
    # fmt: on
