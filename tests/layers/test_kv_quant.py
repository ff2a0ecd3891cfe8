"""The quantized KV cache (`kv_cache_dtype` int8 / fp8, `kv_quant.py`): a row written and read
back stays within its format's rounding; our paged decode kernel, reading the codes and scales
directly, matches SDPA over the dequantized rows and stays near the float reference; fp32
models over a quantized cache get the kernel; the pool's bytes per token; the clear errors."""

from __future__ import annotations

import platform

import pytest
import torch
from support.model_fixtures import make_attention_metadata

from minivllm.config import EngineConfig
from minivllm.layers.attention import kv_quant
from minivllm.layers.attention.backends import AttentionSpec, choose_backend
from minivllm.layers.attention.paged_decode import paged_decode_attention
from minivllm.layers.attention.sdpa import paged_attention_sdpa

x86 = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 (AVX2) kernel"
)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_row_reads_back_within_its_rounding(kind):
    """int8: each value within half its row's step (amax / 127 / 2); fp8 e4m3: within 2^-4
    relative (3 mantissa bits), values past 448 clamped; an all-zero row stays zero."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=gen) * torch.tensor([0.01, 1, 10, 100, 1000])[:, None, None]
    x[0] = 0.0
    cache = kv_quant.allocate_kv_cache((2, 4, 2, 16), kind, torch.float32, torch.device("cpu"))
    slots = torch.tensor([6, 0, 3, 7, 1])
    kv_quant.store_kv(x, x, cache, slots)
    got = kv_quant.gather_rows(cache, 1, slots, torch.float32)  # [5, 2, 16]
    assert got[0].eq(0).all()
    if kind == "int8":
        step = x.abs().amax(-1, keepdim=True) / 127
        assert ((got - x).abs() <= step / 2 + 1e-6).all()
    else:
        want = x.clamp(-448, 448)
        assert ((got - want).abs() <= want.abs() / 16 + 2**-9).all()


def _quantized_step(kind, tables, context, heads, kv_heads, dim, block, seed):
    """A decode-only step over a quantized cache holding random rows at each sequence's
    positions, the float rows kept for the reference."""
    gen = torch.Generator().manual_seed(seed)
    meta, _ = make_attention_metadata(tables, context, [1] * len(tables), block)
    num_blocks = 1 + max(max(t) for t in tables)
    shape = (num_blocks, block, kv_heads, dim)
    cache = kv_quant.allocate_kv_cache(shape, kind, torch.float32, torch.device("cpu"))
    floats = (torch.zeros(shape), torch.zeros(shape))
    slots = meta.kv_gather_index.view(-1).unique()
    k = torch.randn(len(slots), kv_heads, dim, generator=gen) * 3
    v = torch.randn(len(slots), kv_heads, dim, generator=gen)
    kv_quant.store_kv(k, v, cache, slots)
    floats[0].view(-1, kv_heads, dim)[slots] = k
    floats[1].view(-1, kv_heads, dim)[slots] = v
    q = torch.randn(len(tables), heads, dim, generator=gen)
    return meta, cache, floats, q


@x86
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, 2.0)])
@pytest.mark.parametrize("heads, kv_heads, dim, block", [(6, 2, 8, 4), (9, 3, 64, 16)])
def test_the_kernel_reads_the_quantized_cache(kind, window, softcap, heads, kv_heads, dim, block):
    """The kernel over codes (and scales) equals SDPA over the same rows dequantized, and is
    near attention over the rows before quantization."""
    tables = [[3, 1, 4, 7, 9], [0, 2], [5], [8, 6, 10, 11]]
    context = [min(len(t) * block - 1, c) for t, c in zip(tables, [17, 6, 0, 35], strict=True)]
    meta, cache, floats, q = _quantized_step(kind, tables, context, heads, kv_heads, dim, block, 1)
    scale = dim**-0.5
    got = paged_decode_attention(
        q, cache[0], cache[1], meta.block_tables, meta.seq_lens, scale,
        torch.tensor(window or 0), softcap, *kv_quant.kv_scales(cache),
    )  # fmt: skip
    every = torch.arange(cache[0].numel() // (kv_heads * dim))
    dequantized = [kv_quant.gather_rows(cache, i, every, torch.float32) for i in (0, 1)]
    dequantized = [t.view(cache[0].shape) for t in dequantized]
    want = paged_attention_sdpa(q, *dequantized, meta, scale, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    reference = paged_attention_sdpa(q, *floats, meta, scale, window, softcap)
    assert (got - reference).abs().max() < (0.05 if kind == "int8" else 0.3)


def test_the_sdpa_path_reads_the_quantized_cache():
    """A prefill with cached context (the SDPA path) over the int8 cache, its scales passed
    in, equals SDPA over the dequantized rows."""
    meta, cache, _, _ = _quantized_step("int8", [[2, 0, 1]], [9], 4, 2, 16, 4, 2)
    prefill, _ = make_attention_metadata([[2, 0, 1]], [6], [4], 4)
    q = torch.randn(4, 4, 16)
    got = paged_attention_sdpa(q, cache[0], cache[1], prefill, 0.25, kv_scales=cache[2:])
    every = torch.arange(cache[0].numel() // 32)
    rows = [
        kv_quant.gather_rows(cache, i, every, torch.float32).view(cache[0].shape) for i in (0, 1)
    ]
    torch.testing.assert_close(got, paged_attention_sdpa(q, *rows, prefill, 0.25))


@x86
def test_fp32_models_over_a_quantized_cache_decode_through_the_kernel():
    """The kernel reads the codes; SDPA would widen every gathered row, every step."""
    for kv_dtype in (torch.int8, kv_quant.FP8):
        spec = AttentionSpec(torch.device("cpu"), torch.float32, kv_dtype, 64, 16)
        assert choose_backend(spec).name == "paged_decode"


def test_bytes_per_token_count_the_scales():
    """int8 at head_dim 64: 64 codes + a 4-byte scale per head, against bf16's 128 bytes."""
    args = (torch.bfloat16, 3, 64)
    assert kv_quant.bytes_per_token("auto", *args) == 2 * 3 * 64 * 2
    assert kv_quant.bytes_per_token("int8", *args) == 2 * 3 * (64 + 4)
    assert kv_quant.bytes_per_token("fp8", *args) == 2 * 3 * 64


def test_bad_kv_cache_dtypes_are_refused():
    """An unknown name, and a quantized cache on a device no attention path of ours reads:
    CUDA without triton, or another accelerator."""
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, int8, fp8"):
        EngineConfig(kv_cache_dtype="q4")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype=int8 needs the CPU, or CUDA with triton"):
        kv_quant.check_kv_cache_dtype("int8", cuda, triton=False)
    with pytest.raises(ValueError, match="on mps use kv_cache_dtype=auto"):
        kv_quant.check_kv_cache_dtype("fp8", torch.device("mps"), triton=True)
    kv_quant.check_kv_cache_dtype("fp8", cuda, triton=True)
    kv_quant.check_kv_cache_dtype("int8", torch.device("cpu"), triton=False)
    kv_quant.check_kv_cache_dtype("auto", cuda, triton=False)
    with pytest.raises(ValueError, match="kv_cache_dtype=bfloat16 on cuda needs dtype bfloat16"):
        kv_quant.resolve_kv_cache_dtype("bfloat16", "float16", torch.float16, cuda)


def test_auto_is_bf16_where_the_cpu_computes_fp32_by_default():
    """`auto` under fp32 maths the engine chose (dtype auto on a CPU without native bf16) is a
    bf16 cache; a dtype the user names keeps the cache in it; other options stay as given."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    resolve = kv_quant.resolve_kv_cache_dtype
    assert resolve("auto", "auto", torch.float32, cpu) == "bfloat16"
    assert resolve("auto", None, torch.float32, cpu) == "bfloat16"
    assert resolve("auto", "float32", torch.float32, cpu) == "auto"
    assert resolve("auto", "auto", torch.bfloat16, cpu) == "auto"
    assert resolve("auto", "auto", torch.bfloat16, cuda) == "auto"
    assert resolve("int8", "auto", torch.float32, cpu) == "int8"
    assert resolve("bfloat16", "float32", torch.float32, cpu) == "bfloat16"
    assert kv_quant.kv_storage_dtype("bfloat16", torch.float32) == torch.bfloat16


def test_a_bf16_cache_reads_back_what_the_step_attends_to():
    """Under fp32 maths a bf16 cache's rows come back rounded; the step's own K/V round the
    same way, so a lone prefill equals the same tokens read from the cache."""
    cache = kv_quant.allocate_kv_cache(
        (2, 4, 2, 16), "bfloat16", torch.float32, torch.device("cpu")
    )
    new = torch.randn(3, 2, 16)
    kv_quant.store_kv(new, new, cache, torch.tensor([0, 1, 5]))
    read = kv_quant.gather_rows(cache, 0, torch.tensor([0, 1, 5]), torch.float32)
    assert not torch.equal(read, new)
    assert torch.equal(kv_quant.as_read_back(new, cache[0]), read)
    fp32 = kv_quant.allocate_kv_cache((2, 4, 2, 16), "auto", torch.float32, torch.device("cpu"))
    assert kv_quant.as_read_back(new, fp32[0]) is new


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_a_cpu_pool_is_zero_aligned_and_resident_only_where_written(kind: str) -> None:
    """The CPU pool reads as zeros (padded gathers read unused slots, which must be finite),
    sits at torch's alignment, and takes resident memory only for the pages a step wrote: a
    256 MiB layer costs nothing at start-up."""

    def rss_mib() -> float:
        status = open("/proc/self/status").read()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    if platform.system() != "Linux":
        pytest.skip("reads /proc/self/status")
    shape = (4096, 16, 8, 128)  # 64 Mi values: 128 MiB a tensor in bf16
    before = rss_mib()
    cache = kv_quant.allocate_kv_cache(shape, kind, torch.bfloat16, torch.device("cpu"))
    assert rss_mib() - before < 32
    for t in cache:
        assert t.data_ptr() % 64 == 0
        # a tensor of its own at its storage's start, which a compiled step writes in place
        assert t._base is None and t.storage_offset() == 0
        assert not t[:2].view(torch.uint8).any()  # the first blocks only: reads touch pages
    cache[0][0].view(torch.uint8).fill_(1)  # one block written: its pages, not the pool's
    assert rss_mib() - before < 48


@pytest.mark.parametrize("d", [16, 64, 80, 128, 256])
def test_the_key_turn_is_orthonormal_and_fixed(d: int) -> None:
    """Scores q.k survive the turn exactly (up to fp32 rounding); the same matrix in every
    process (a cache's bytes must not depend on who wrote them): built again, bit-equal."""
    turn = kv_quant.key_rotation(d, torch.device("cpu"))
    assert turn.shape == (d, d) and turn.dtype == torch.float32
    torch.testing.assert_close(turn @ turn.T, torch.eye(d), atol=1e-6, rtol=0)
    assert torch.equal(turn, kv_quant.key_rotation.__wrapped__(d, torch.device("cpu")))


def test_the_turn_keeps_a_huge_key_channel_from_rounding_the_others_away() -> None:
    """Keys with one rotary pair at 300 (the rest N(0, 1)), as a real Qwen2.5's layer 0 holds:
    int8 with the turn scores random queries at least 2x closer to the float scores."""
    gen = torch.Generator().manual_seed(1)
    d = 128
    keys = torch.randn(64, 1, d, generator=gen)
    keys[:, :, 3], keys[:, :, 3 + d // 2] = 300.0, -200.0
    queries = torch.randn(32, d, generator=gen)
    turn = kv_quant.key_rotation(d, torch.device("cpu"))

    def score_error(q: torch.Tensor, k: torch.Tensor) -> float:
        codes, scale = kv_quant.quantize_int8(k)
        back = codes.float() * scale[..., None]
        return ((q @ back[:, 0].T) - (q @ k[:, 0].T)).abs().mean().item()

    assert score_error(queries @ turn, keys @ turn) * 2 < score_error(queries, keys)
