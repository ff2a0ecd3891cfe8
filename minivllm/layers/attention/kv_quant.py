"""What the KV cache stores (`kv_cache_dtype`): as computed (or bf16), int8 with scales, or fp8.

A layer's cache is `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]`, in the compute dtype (`auto`; bf16 under fp32 maths by default, see
`resolve_kv_cache_dtype`), bf16 (`bfloat16`) or float8 e4m3 (`fp8`: cast, no scale; e4m3 keeps
a value's relative error at 2^-4 whatever its size, so K/V need no range scaling below its
448 ceiling). `int8` adds each row's scale beside the pool: `(k_cache, v_cache, k_scale,
v_scale)`, the scales `[num_blocks, block_size, num_kv_heads]` float32, row = codes * scale.

Why a scale per token and KV head (not per block and head, as a q8_0-like block scale): the
cache is written a token at a time, and a per-token scale is fixed by the row alone, so a
write never rewrites the rows beside it, a block's bytes do not depend on the order its
tokens came in (prefix caching, preemption's recompute and speculative rollback see the
same bytes), and an outlier token costs only its own row's precision. Its price is 4 bytes
per head_dim values (8.5 bits a value at head_dim 64, 8.25 at 128); docs/memory.md has the
measured error of both choices.

Readers: `store_kv` writes (quantizing); `gather_rows` reads the rows a step gathers,
widened to the maths' dtype (the SDPA path, which dequantizes only what it reads); the CPU's
paged decode kernel and, on CUDA, the Triton paged-attention kernel read the codes and scales
directly.
"""

from __future__ import annotations

import functools
import math
import mmap

import torch

KVCache = tuple[torch.Tensor, ...]  # (k, v) or, int8, (k, v, k_scale, v_scale)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value: larger ones are clamped to it
INT8_MAX = 127.0
# The smallest scale: an all-zero row (the pool's unused slots) stays zero, not NaN.
MIN_SCALE = 1e-8


def kv_storage_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache's K/V tensors for option `kv_cache_dtype`."""
    return {"auto": compute_dtype, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": FP8}[
        kv_cache_dtype
    ]


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: str | None, compute_dtype: torch.dtype, device: torch.device
) -> str:
    """The cache option a runner builds for (`dtype`: the engine's dtype option as given):
    `auto` is the compute dtype, except on a CPU that computes in fp32 because `dtype` was
    left `auto` (no native bf16 maths): there bf16, the cache the same model gets on a CPU
    with bf16 maths (llama.cpp's default is 16-bit too). Why: one decode step reads the whole
    context's K/V, and an fp32 cache doubles those bytes, which at a long context cost more
    than the weights (Gemma-3-270M at 8k tokens, docs/memory.md). An fp32 cache stays one
    `dtype="float32"` away, where greedy output equals HF fp32's token for token."""
    check_kv_cache_dtype(kv_cache_dtype, device)
    if kv_cache_dtype == "bfloat16" and device.type != "cpu" and compute_dtype != torch.bfloat16:
        raise ValueError(
            f"kv_cache_dtype=bfloat16 on {device.type} needs dtype bfloat16 (its attention "
            f"kernels read a cache in the compute dtype); use kv_cache_dtype=auto"
        )
    fp32_by_default = dtype in (None, "auto") and compute_dtype == torch.float32
    if kv_cache_dtype == "auto" and device.type == "cpu" and fp32_by_default:
        return "bfloat16"
    return kv_cache_dtype


def check_kv_cache_dtype(
    kv_cache_dtype: str, device: torch.device, triton: bool | None = None
) -> None:
    """ValueError where no attention path of ours reads a quantized cache: the CPU's (SDPA and
    the paged decode kernel) and, on CUDA, the Triton kernel (`triton`: whether it imports;
    None: look). flash-attn reads bf16/fp16 caches only and steps aside for them."""
    if kv_cache_dtype in ("auto", "bfloat16") or device.type == "cpu":
        return
    if triton is None:
        from minivllm.layers.attention.triton_attention import triton_available

        triton = triton_available()
    if device.type != "cuda" or not triton:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype} needs the CPU, or CUDA with triton (our paged "
            f"attention kernel reads it as stored); on {device.type}"
            f"{'' if device.type != 'cuda' else ' without triton'} use kv_cache_dtype=auto"
        )


def bytes_per_token(kv_cache_dtype: str, compute_dtype: torch.dtype, kv_heads: int, d: int) -> int:
    """One token's K and V bytes in one layer, scales included."""
    element = torch.tensor([], dtype=kv_storage_dtype(kv_cache_dtype, compute_dtype))
    scales = 2 * kv_heads * 4 if kv_cache_dtype == "int8" else 0
    return 2 * kv_heads * d * element.element_size() + scales


def allocate_kv_cache(
    shape: tuple[int, int, int, int],
    kv_cache_dtype: str,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """One layer's cache of `shape` `[blocks, block_size, KVH, D]`, zeroed: padded gathers
    read unused slots, which must be finite."""
    dtype = kv_storage_dtype(kv_cache_dtype, compute_dtype)
    k, v = (_zeros(shape, dtype, device) for _ in range(2))
    if kv_cache_dtype != "int8":
        return k, v
    k_scale, v_scale = (_zeros(shape[:3], torch.float32, device) for _ in range(2))
    return k, v, k_scale, v_scale


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU from an anonymous memory map: the system hands out zero
    pages as they are first touched, so the pool costs neither the start-up's time to write
    it (seconds for gigabytes on a busy machine) nor resident memory until a slot is used.

    A tensor of its own at the map's page-aligned start, neither a view of another tensor nor
    at an offset into its storage: the compiled decode step writes the new keys into its
    input in place only then; through a view at an offset, every step copied the whole pool
    (docs/performance.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)
    stride = torch.empty(shape, dtype=dtype, device="meta").stride()
    return torch.empty(0, dtype=dtype).set_(pages.untyped_storage(), 0, shape, stride)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[T, KVH, D]` -> (codes `[T, KVH, D]` int8, scales `[T, KVH]` float32), symmetric:
    each row's largest magnitude maps to 127."""
    x = x.float()
    scale = (x.abs().amax(-1) / INT8_MAX).clamp_min(MIN_SCALE)  # [T, KVH]
    codes = torch.round(x / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


@functools.cache
def key_rotation(d: int, device: torch.device) -> torch.Tensor:
    """The `[D, D]` float32 turn an int8 cache's layers give queries and keys alike.

    Why: some models' keys carry a few very large channels (a 1.5B Qwen2.5's reach 356, the
    rest tens), and with one scale per row those channels set the int8 step, so the small
    ones that tell keys apart round away. An orthonormal turn of both leaves every score q.k
    as it was and spreads a large channel over all D, so a row's step falls to its typical
    size. Values stay as computed (their rounding is not amplified by a few channels).

    A Hadamard matrix with seeded sign flips of its rows where D is a power of two (any one
    channel spreads evenly), else a seeded random orthogonal matrix; fixed, so a cache's bytes
    do not depend on the process that wrote them."""
    gen = torch.Generator().manual_seed(0)
    if d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d, 1), generator=gen, dtype=torch.float64) * 2 - 1
        turn = signs * h / math.sqrt(d)
    else:
        turn, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return turn.to(device=device, dtype=torch.float32)


def as_read_back(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`x` (new keys or values in the maths' dtype) as the cache gives it back: rounded
    through a narrower float cache (bf16 under fp32 maths), so that attention over the step's
    own K/V equals attention over the same rows read from the cache (a prefix-cache hit, a
    chunked prefill). Quantized caches' rows are left as computed."""
    if cache.dtype == torch.bfloat16 and x.dtype == torch.float32:
        return x.to(torch.bfloat16).to(x.dtype)
    return x


def _as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache's dtype; fp8 as its bytes (torch's CPU index_copy_/index_select have
    no float8 kernels, uint8 ones move the same bytes)."""
    if dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return x.to(dtype)


def _slots(cache: torch.Tensor) -> torch.Tensor:
    """`[slots, KVH, D]` view of a cache (fp8 viewed as uint8, see `_as_stored`)."""
    num_kv_heads, head_dim = cache.shape[-2:]
    if cache.dtype == FP8:
        cache = cache.view(torch.uint8)
    return cache.view(-1, num_kv_heads, head_dim)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Write new keys/values `[num_tokens, num_kv_heads, head_dim]` into their cache slots, in
    the cache's stored form."""
    if len(kv_cache) == 4:
        for new, cache, scales in ((k, kv_cache[0], kv_cache[2]), (v, kv_cache[1], kv_cache[3])):
            codes, scale = quantize_int8(new)
            _slots(cache).index_copy_(0, slot_mapping, codes)  # [slots, KVH, D]
            scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, scale)  # [slots, KVH]
        return
    for new, cache in ((k, kv_cache[0]), (v, kv_cache[1])):
        _slots(cache).index_copy_(0, slot_mapping, _as_stored(new, cache.dtype))


def gather_rows(
    kv_cache: KVCache, which: int, index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The rows at slots `index` (any shape I) of K (`which` 0) or V (1), widened to `dtype`:
    `[*I, KVH, D]`."""
    cache = kv_cache[which]
    rows = _slots(cache)[index]  # [*I, KVH, D]
    if cache.dtype == FP8:
        return rows.view(FP8).to(dtype)
    if len(kv_cache) == 4:
        scales = kv_cache[2 + which]
        scale = scales.view(-1, scales.shape[-1])[index]  # [*I, KVH]
        return (rows.to(dtype) * scale[..., None].to(dtype)).to(dtype)
    return rows.to(dtype)


def kv_scales(kv_cache: KVCache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The int8 cache's (k_scale, v_scale), else (None, None)."""
    if len(kv_cache) == 4:
        return kv_cache[2], kv_cache[3]
    return None, None
