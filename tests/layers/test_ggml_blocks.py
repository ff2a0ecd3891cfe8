"""The GGUF block kernels (`minivllm.layers.quantization.kernels.ggml_blocks`) against gguf-py,
llama.cpp's own Python reading of the same blocks: dequantization bit for bit, matmuls within the
rounding of the activations to 8 bits, on every instruction-set path that runs here (scalar, AVX2,
and AVX-512 VNNI where the CPU has it; `make test-avx2` runs the file again with torch's AVX2
kernels, where "auto" must take the AVX2 path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.kernels.ggml_blocks import (
    GGML_KERNEL_TYPES,
    X8_FLAG,
    X8_KINDS,
    available_isas,
    block_geometry,
    dequant_matmul,
    dequant_scratch_bytes,
    dequant_tile_bytes,
    ggml_dequantize,
    ggml_matmul,
    ggml_matmul_segments,
    last_level_cache_bytes,
    repack_q4x8,
)

T = GGMLQuantizationType
TYPES = sorted(GGML_KERNEL_TYPES, key=int)
pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the block kernels are for x86 CPUs with AVX2"
)
ISAS = [isa for isa in ("scalar", "avx2", "avx512_vnni", "amx") if isa in available_isas()]


def random_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """`[n, row_bytes]` valid blocks: gguf-py's own quantizer where it has one, else random
    codes and scales with finite, small fp16 `d` (and `dmin`)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        return quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05, qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:  # fp16 values as their two bytes
        values = (rng.random((n, k // elems)) + 0.1) * scale
        return values.astype(np.float16).view(np.uint8).reshape(n, k // elems, 2)

    if qtype == T.Q6_K:
        blocks[..., 208:210] = halves(0.002)
    else:
        blocks[..., 0:2], blocks[..., 2:4] = halves(0.002), halves(0.01)
    return blocks.reshape(n, -1)


def dequantized(blocks: np.ndarray, qtype: T, k: int) -> torch.Tensor:
    """The weights as gguf-py dequantizes them, `[N, K]` float64."""
    return torch.from_numpy(dequantize(blocks, qtype).reshape(blocks.shape[0], k)).double()


def reference(w: torch.Tensor, x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What the kernel computes, in float64: the activations rounded to int8 with one step per
    `block` inputs (32; 256 for the K kinds), nearest even, for the codes' products and the
    min terms alike (the codes' sums, as llama.cpp: with x's exact sums the unsigned codes'
    rounding error would not cancel)."""
    k = x.shape[-1]
    groups = x.float().reshape(-1, k // block, block)  # [M, K / block, block]
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # 127 / amax as one division (torch's `127.0 / t` multiplies by a reciprocal: other ties)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = ((groups * inverse).round() * (amax / 127.0)).reshape(-1, k).double()  # [M, K]
    return xq @ w.T


def activation_block(qtype: T) -> int:
    """Inputs a step of the activations' int8 rounding covers for this weight kind."""
    return 256 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 32


def k_of(qtype: T, blocks: int = 3) -> int:
    return block_geometry(qtype)[0] * blocks


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_for_bit(qtype: T, isa: str) -> None:
    """fp32 values equal gguf-py's; bf16 ones are those rounded to nearest even."""
    k = k_of(qtype)
    blocks = random_blocks(qtype, 7, k)
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(7, k).astype(np.float32))
    raw = torch.from_numpy(blocks)
    assert torch.equal(ggml_dequantize(raw, qtype, k, isa=isa), expected)
    assert torch.equal(ggml_dequantize(raw, qtype, k, torch.bfloat16, isa=isa), expected.bfloat16())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype: T, isa: str) -> None:
    """Every row count up to 9 (tiles of 4 and each remainder) and an odd N match the
    quantized-activation reference closely, and the fp32 product within 8-bit rounding."""
    k, n = k_of(qtype), 13
    blocks = random_blocks(qtype, n, k, seed=1)
    raw = torch.from_numpy(blocks)
    w = dequantized(blocks, qtype, k)
    torch.manual_seed(0)
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, k)
        y = ggml_matmul(x, raw, qtype, isa=isa)
        assert y.shape == (m, n) and y.dtype == torch.float32
        expected = reference(w, x, activation_block(qtype))
        scale = expected.abs().max()
        assert (y.double() - expected).abs().max() <= 2e-5 * scale, (m, qtype.name)
        dense = x.double() @ w.T
        assert (y.double() - dense).abs().max() <= 3e-2 * dense.abs().max()


@pytest.mark.parametrize("isa", ISAS)
def test_segments_are_the_single_matmuls_side_by_side(isa: str) -> None:
    """A fused layer's segments of different kinds (as Q4_K_M's qkv: Q4_K, Q4_K, Q6_K) in one
    call equal each segment's own matmul, for a decode row and a prefill of 70 rows (more than
    the kernel's chunk of 64)."""
    k = 512
    kinds = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K)
    parts = [
        torch.from_numpy(random_blocks(kind, 3 + i, k, seed=i)) for i, kind in enumerate(kinds)
    ]
    for m in (1, 70):
        x = torch.randn(m, k)
        fused = ggml_matmul_segments(x, list(zip(parts, kinds)), isa=isa)
        single = torch.cat(
            [ggml_matmul(x, raw, kind, isa=isa) for raw, kind in zip(parts, kinds)], dim=-1
        )
        assert fused.shape == (m, sum(p.shape[0] for p in parts))
        assert torch.equal(fused, single)
        dense = (
            x.double()
            @ torch.cat([dequantized(raw.numpy(), kind, k) for raw, kind in zip(parts, kinds)]).T
        )
        assert (fused.double() - dense).abs().max() <= 3e-2 * dense.abs().max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_x8_layout_matches_the_float_product(qtype: T, isa: str) -> None:
    """Q4_0/Q4_1/Q8_0/Q5_0 repacked 8 rows at a time, with two int8 codes an activation, match
    the fp64 product of gguf-py's weights within about 15 bits, far closer than the stored
    layout's kernel (one code), for decode rows, each remainder of 4 and a prefill of more
    than 64 rows; every path gives the scalar path's result; fused beside other kinds each
    segment equals its own matmul; dequantizing the tiles gives gguf-py's values."""
    k, n = 96, 40
    blocks = random_blocks(qtype, n, k, seed=3)
    if qtype == T.Q8_0:  # the extreme codes, -128 and 127: the int16 and int32 sums' worst case
        codes = blocks.reshape(n, k // 32, 34)[:8, :, 2:]
        codes[:4], codes[4:] = np.uint8(0x80), np.uint8(0x7F)
    raw = torch.from_numpy(blocks)
    tiles = repack_q4x8(raw, qtype)
    stored = T.Q8_0 if qtype == T.Q5_0 else qtype  # Q5_0's tiles hold a byte a code
    assert tiles.shape == (n // 8, 8 * GGML_QUANT_SIZES[stored][1] * k // 32)
    assert tiles.dtype == torch.uint8
    w = dequantized(blocks, qtype, k)
    ops, x8 = torch.ops.minivllm, int(qtype) + X8_FLAG
    torch.manual_seed(0)
    for m in (1, 2, 3, 4, 5, 9, 16, 70):
        x = torch.randn(m, k)
        y = ops.ggml_matmul_segments(x, [tiles], [x8], ISAS.index(isa) + 1)
        scalar = ops.ggml_matmul_segments(x, [tiles], [x8], 1)
        torch.testing.assert_close(y, scalar, rtol=1e-5, atol=1e-6 * scalar.abs().max())
        exact = x.double() @ w.T
        error = (y.double() - exact).abs().max()
        assert error <= 1e-4 * exact.abs().max(), m
        assert error * 20 <= (ggml_matmul(x, raw, qtype).double() - exact).abs().max(), m
    other = torch.from_numpy(random_blocks(T.Q8_0, 5, k, seed=4))
    x = torch.randn(3, k)
    fused = ops.ggml_matmul_segments(x, [other, tiles, other], [int(T.Q8_0), x8, int(T.Q8_0)], 0)
    single = [ggml_matmul(x, other, T.Q8_0), ops.ggml_matmul_segments(x, [tiles], [x8], 0)]
    assert torch.equal(fused, torch.cat([single[0], single[1], single[0]], dim=-1))
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k))
    assert torch.equal(ops.ggml_dequantize(tiles, x8, k, torch.float32, 0), expected)
    tiled = ops.ggml_dequant_matmul(x, tiles, x8, 16)
    torch.testing.assert_close(tiled, ops.ggml_dequant_matmul(x, raw, int(qtype), 16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", sorted(X8_KINDS, key=int), ids=lambda t: t.name)
def test_dequantize_picks_rows_out_of_tiles(qtype: T, isa: str) -> None:
    """Asked for some rows (as the LM head's refinement and a tiled embedding ask), the
    tiles' rows come back alone, in the order asked, repeats included: gguf-py's values, as
    from the stored blocks; a row past the weight is an error that names it."""
    k, n = 512, 24
    blocks = random_blocks(qtype, n, k, seed=5)
    raw, tiles = torch.from_numpy(blocks), repack_q4x8(torch.from_numpy(blocks), qtype)
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k))
    ids = torch.tensor([23, 0, 9, 9, 16, 7, 8])  # the last tile's last row, each tile's edges
    ops, isa_arg, x8 = torch.ops.minivllm, ISAS.index(isa) + 1, int(qtype) + X8_FLAG
    for dtype in (torch.float32, torch.bfloat16):
        want = expected[ids].to(dtype)
        assert torch.equal(ops.ggml_dequantize(tiles, x8, k, dtype, isa_arg, ids), want)
        assert torch.equal(ops.ggml_dequantize(raw, int(qtype), k, dtype, isa_arg, ids), want)
    with pytest.raises(RuntimeError, match="ids\\[1\\] = 24 is not a row"):
        ops.ggml_dequantize(tiles, x8, k, torch.float32, 0, torch.tensor([3, 24]))


# Bytes a row takes in one x8 block of 256 inputs: Q4_K its nibbles, its 8 scales and 8 mins
# a byte each, its d and dmin; Q6_K its codes' 4 + 2 bits, its 16 scales, its d, its int32
# offset.
X8_K_ROW_BYTES = {T.Q4_K: 128 + 8 + 8 + 2 + 2, T.Q6_K: 128 + 64 + 16 + 2 + 4}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_k_x8_layout_computes_the_stored_blocks_integers(qtype: T, isa: str) -> None:
    """Q4_K and Q6_K in tiles of 8 rows give the stored layout's results (the same activations
    and integers; only the order of fp32 sums differs) for decode rows, each remainder of 4 and
    of 8 (VNNI's kernels take 8 rows at once) and a prefill of more than 64 rows; moved back,
    gguf-py's values. Q6_K's random scales reach -128 and its codes 0 and 63: the int16 sums'
    worst case."""
    k, n = 512, 24
    blocks = random_blocks(qtype, n, k, seed=5)
    raw = torch.from_numpy(blocks)
    tiles = repack_q4x8(raw, qtype)
    assert tiles.shape == (n // 8, 8 * X8_K_ROW_BYTES[qtype] * k // 256)
    ops, x8 = torch.ops.minivllm, int(qtype) + X8_FLAG
    torch.manual_seed(0)
    for m in (1, 2, 3, 4, 5, 8, 9, 13, 16, 70):
        x = torch.randn(m, k)
        y = ops.ggml_matmul_segments(x, [tiles], [x8], ISAS.index(isa) + 1)
        stored = ggml_matmul(x, raw, qtype, isa=isa)
        torch.testing.assert_close(y, stored, rtol=1e-5, atol=1e-5 * stored.abs().max())
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k))
    assert torch.equal(ops.ggml_dequantize(tiles, x8, k, torch.float32, 0), expected)
    # bf16 (the AMX path's tiles): those values rounded to nearest even; through the tiles'
    # matmul in ranges of 12 rows, whole tiles and rows of split ones alike
    bf16 = ops.ggml_dequantize(tiles, x8, k, torch.bfloat16, 0)
    assert torch.equal(bf16, expected.to(torch.bfloat16))
    x = torch.randn(5, k, dtype=torch.bfloat16)
    tiled = ops.ggml_dequant_matmul(x, tiles, x8, 12)
    torch.testing.assert_close(tiled, x @ bf16.T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_x8_tile_pairs_give_each_row_its_own_result(qtype: T, isa: str) -> None:
    """With 8448 inputs VNNI takes the tiles two at a time from 8 rows (the rows' codes past 64
    KB for the K kinds, 16 KB for Q8_0/Q5_0; else from 32 / 16 rows): around those counts, with
    an odd last tile, each row's result is bit for bit what it gives alone (one row: single
    tiles), so a sequence's logits do not depend on the batch it shares a step with; and the
    K kinds give the stored layout's results (Q8_0/Q5_0's tiles take two codes an activation:
    test_x8_layout_matches_the_float_product)."""
    k, n = 8448, 24
    blocks = random_blocks(qtype, n, k, seed=9)
    raw = torch.from_numpy(blocks)
    tiles = repack_q4x8(raw, qtype)

    def tiled(x: torch.Tensor) -> torch.Tensor:
        kinds = [int(qtype) + X8_FLAG]
        return torch.ops.minivllm.ggml_matmul_segments(x, [tiles], kinds, ISAS.index(isa) + 1)

    torch.manual_seed(1)
    for m in (4, 7, 8, 12, 16, 33):
        x = torch.randn(m, k)
        y = tiled(x)
        assert torch.equal(y, torch.cat([tiled(row[None]) for row in x])), m
        if qtype in (T.Q4_K, T.Q6_K):
            stored = ggml_matmul(x, raw, qtype, isa=isa)
            torch.testing.assert_close(y, stored, rtol=1e-5, atol=1e-5 * stored.abs().max())


@pytest.mark.skipif("amx" not in ISAS, reason="no AMX here (or torch runs its AVX2 kernels)")
def test_amx_gives_the_vnni_kernels_results_bit_for_bit() -> None:
    """Q4_K's and Q6_K's x8 tiles on AMX (from 14 rows: two codes of 7 decodes), and Q8_0's and
    Q5_0's (from 4 rows, 16 a pass), compute the VNNI kernels' integers and float work: equal
    results, every row count around the thresholds (fewer than 14 rows, 14-16 on half the
    tiles, 32 a pass, a second pass of 1..32), odd tiles at a range's end, fused segments of
    all four kinds, activations with outliers, Q6_K's random scales reaching -128 and its
    codes 0 and 63, Q8_0's codes -128..127."""
    k = 768
    blocks = {  # 5 tiles (a lone last one), 3, 3, 4
        T.Q4_K: random_blocks(T.Q4_K, 40, k, seed=3),
        T.Q6_K: random_blocks(T.Q6_K, 24, k, seed=4),
        T.Q8_0: random_blocks(T.Q8_0, 24, k, seed=5),
        T.Q5_0: random_blocks(T.Q5_0, 32, k, seed=6),
    }
    tiles = [repack_q4x8(torch.from_numpy(b), qtype) for qtype, b in blocks.items()]
    kinds = [int(qtype) + X8_FLAG for qtype in blocks]
    ops = torch.ops.minivllm
    torch.manual_seed(1)
    for m in (1, 3, 4, 5, 13, 14, 15, 16, 17, 31, 32, 33, 48, 64, 70):
        x = torch.randn(m, k) * torch.rand(m, k).pow(8).mul(60).add(1)
        vnni = ops.ggml_matmul_segments(x, tiles, kinds, ISAS.index("avx512_vnni") + 1)
        assert torch.equal(ops.ggml_matmul_segments(x, tiles, kinds, ISAS.index("amx") + 1), vnni)
        assert torch.equal(ops.ggml_matmul_segments(x, tiles, kinds, 0), vnni), m  # auto: AMX
        for one, kind in zip(tiles[2:], kinds[2:]):  # each alone: the odd tile, every pass
            vnni = ops.ggml_matmul_segments(x, [one], [kind], ISAS.index("avx512_vnni") + 1)
            assert torch.equal(ops.ggml_matmul_segments(x, [one], [kind], 0), vnni), (m, kind)


@pytest.mark.skipif("avx512_vnni" not in ISAS, reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_vnni_gives_the_avx2_kernels_results_bit_for_bit(qtype: T) -> None:
    """The K kinds' tiles on AVX-512 VNNI (Q6_K two tiles at a time on 512-bit vectors, an odd
    last one alone) compute AVX2's integers and float work: equal results at every row count
    the tile loop splits differently (1..8 rows at once, 64-row chunks)."""
    k = 512
    tiles = repack_q4x8(torch.from_numpy(random_blocks(qtype, 40, k, seed=4)), qtype)
    kind = [int(qtype) + X8_FLAG]
    torch.manual_seed(2)
    for m in (1, 2, 5, 8, 9, 16, 33, 70):
        x = torch.randn(m, k) * torch.rand(m, k).pow(8).mul(60).add(1)
        ops = torch.ops.minivllm
        avx2 = ops.ggml_matmul_segments(x, [tiles], kind, ISAS.index("avx2") + 1)
        vnni = ops.ggml_matmul_segments(x, [tiles], kind, ISAS.index("avx512_vnni") + 1)
        assert torch.equal(vnni, avx2), m


def test_x8_bad_input_is_a_clear_error() -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_0, 12, 64))
    with pytest.raises(ValueError, match="multiple of 8|8k"):
        repack_q4x8(raw, T.Q4_0)
    with pytest.raises(ValueError, match="only Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and Q5_0"):
        repack_q4x8(torch.from_numpy(random_blocks(T.Q5_1, 8, 64)), T.Q5_1)
    tiles = repack_q4x8(raw[:8], T.Q4_0)
    with pytest.raises(RuntimeError, match="tiles of .* bytes, expected"):
        torch.ops.minivllm.ggml_matmul_segments(torch.randn(1, 96), [tiles], [int(T.Q4_0) + 256], 0)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_paths_agree(qtype: T) -> None:
    """The vector paths compute the scalar path's integers: the results differ only by the
    order of fp32 additions."""
    k = k_of(qtype, 4)
    raw = torch.from_numpy(random_blocks(qtype, 10, k, seed=2))
    x = torch.randn(3, k)
    outputs = [ggml_matmul(x, raw, qtype, isa=isa) for isa in ISAS]
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-5 * outputs[0].abs().max())


def test_auto_follows_torch_kernels() -> None:
    """The VNNI path runs only where torch runs its AVX-512 kernels, so
    ATEN_CPU_CAPABILITY=avx2 tests the AVX2 path on an AVX-512 machine."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        assert "avx512_vnni" not in available_isas()
    assert {"scalar", "avx2"} <= set(available_isas())


def test_shapes_and_dtypes() -> None:
    """bf16 and batched `[..., K]` activations, one output row, no rows at all."""
    k = 256
    blocks = random_blocks(T.Q4_K, 5, k, seed=3)
    raw = torch.from_numpy(blocks)
    x = torch.randn(2, 3, k)
    y = ggml_matmul(x.bfloat16(), raw, "Q4_K")
    assert y.shape == (2, 3, 5) and y.dtype == torch.float32
    expected = reference(dequantized(blocks, T.Q4_K, k), x.bfloat16().float(), 256)
    expected = expected.reshape(2, 3, 5)
    assert (y.double() - expected).abs().max() <= 2e-5 * expected.abs().max()
    assert ggml_matmul(x[0], raw[:1], T.Q4_K).shape == (3, 1)
    assert ggml_matmul(torch.empty(0, k), raw, T.Q4_K).shape == (0, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_dequant_matmul_tiles(qtype: T, dtype: torch.dtype) -> None:
    """Tiles that do not divide N, one tile, and the shared scratch buffer reused across
    calls of other sizes and dtypes: all equal x @ W.T on the dense weight."""
    for k, n, tile in ((k_of(qtype, 2), 23, 5), (k_of(qtype, 1), 7, None), (k_of(qtype, 3), 9, 64)):
        raw = torch.from_numpy(random_blocks(qtype, n, k, seed=n))
        x = torch.randn(17, k).to(dtype)
        y = dequant_matmul(x, raw, qtype, tile_rows=tile)
        expected = x @ ggml_dequantize(raw, qtype, k, dtype).T
        assert y.dtype == dtype and y.shape == (17, n)
        torch.testing.assert_close(
            y,
            expected,
            rtol=1e-5 if dtype == torch.float32 else 2e-2,
            atol=1e-4 if dtype == torch.float32 else 2e-2,
        )


def test_dequant_matmul_keeps_one_tile() -> None:
    """The only dense memory `dequant_matmul` keeps is one tile of rows, reused by weights of
    any size: never a dense copy of a weight."""
    k = 256
    small = torch.from_numpy(random_blocks(T.Q4_K, 8, k))
    large = torch.from_numpy(random_blocks(T.Q4_K, 200, k))
    x = torch.randn(3, k)
    dequant_matmul(x.bfloat16(), small, T.Q4_K)  # a bf16 buffer: the next call starts anew
    dequant_matmul(x, small, T.Q4_K, tile_rows=64)  # one tile: N = 8 rows of fp32
    assert dequant_scratch_bytes() == 8 * k * 4
    dequant_matmul(x, large, T.Q4_K, tile_rows=16)  # grown to 16 rows
    kept = dequant_scratch_bytes()
    dequant_matmul(x, large, T.Q4_K, tile_rows=16)
    assert dequant_scratch_bytes() == kept == 16 * k * 4


@pytest.mark.parametrize(
    ("reported", "tile"),
    [("491520K", 64 << 20), ("32768K", 8 << 20), ("8M", 4 << 20), ("", 4 << 20), (None, 4 << 20)],
)
def test_dequant_tile_follows_the_l3(tmp_path, reported: str | None, tile: int) -> None:
    """The dequantization tile is a quarter of the L3 Linux reports, within 4-64 MiB; a CPU
    that reports none (or an unreadable size) keeps the smallest."""
    path = tmp_path / "size"
    if reported is not None:
        path.write_text(reported + "\n")
    assert dequant_tile_bytes(last_level_cache_bytes(str(path))) == tile


def test_bad_input_is_a_clear_error() -> None:
    """Wrong row sizes, types and arguments raise ValueError saying what is wrong."""
    raw = torch.from_numpy(random_blocks(T.Q4_K, 4, 512))  # rows of 288 bytes
    x = torch.randn(1, 512)
    with pytest.raises(ValueError, match="512 inputs are 288 bytes, the blocks have 287"):
        ggml_matmul(x, raw[:, :287].contiguous(), T.Q4_K)
    with pytest.raises(ValueError, match="not a whole number of 256-input blocks"):
        ggml_matmul(torch.randn(1, 480), raw, T.Q4_K)
    with pytest.raises(ValueError, match="IQ2_XXS has no block kernel"):
        ggml_matmul(x, raw, T.IQ2_XXS)
    with pytest.raises(ValueError, match="unknown GGML type"):
        block_geometry("Q9_Z")
    with pytest.raises(ValueError, match="uint8"):
        ggml_dequantize(raw.view(torch.int8), T.Q4_K, 512)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ggml_matmul(x.half(), raw, T.Q4_K)
    with pytest.raises(ValueError, match="isa must be one of"):
        ggml_matmul(x, raw, T.Q4_K, isa="neon")
    with pytest.raises(ValueError, match="tile_rows must be positive"):
        dequant_matmul(x, raw, T.Q4_K, tile_rows=0)
    if "avx512_vnni" not in available_isas():
        with pytest.raises(ValueError, match="does not run on this CPU"):
            ggml_matmul(x, raw, T.Q4_K, isa="avx512_vnni")


def test_geometry() -> None:
    """Block sizes as GGUF defines them."""
    assert block_geometry(T.Q4_K) == (256, 144)
    assert block_geometry("q6_k") == (256, 210)
    assert block_geometry(8) == (32, 34)


def test_fake_ops_match_real_ones() -> None:
    """The operators' fake (meta) versions give the real outputs' shapes and dtypes, so
    compiled graphs can call them."""
    raw = torch.from_numpy(random_blocks(T.Q6_K, 4, 256))
    x = torch.randn(2, 256)
    ops = torch.ops.minivllm
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.ggml_matmul.default, (x, raw, int(T.Q6_K), 0), test_utils=checks)
    torch.library.opcheck(
        ops.ggml_matmul_segments.default,
        (x, [raw, raw[:2]], [int(T.Q6_K), int(T.Q6_K)], 0),
        test_utils=checks,
    )
    tiles = repack_q4x8(torch.from_numpy(random_blocks(T.Q4_1, 8, 256)), T.Q4_1)
    torch.library.opcheck(
        ops.ggml_matmul_segments.default,
        (x, [raw, tiles], [int(T.Q6_K), int(T.Q4_1) + X8_FLAG], 0),
        test_utils=checks,
    )
    torch.library.opcheck(
        ops.ggml_dequantize.default, (raw, int(T.Q6_K), 256, torch.bfloat16, 0), test_utils=checks
    )
    torch.library.opcheck(
        ops.ggml_dequant_matmul.default, (x, raw, int(T.Q6_K), 3), test_utils=checks
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_dequant_matmul_writes_each_segment_in_its_columns(dtype: torch.dtype) -> None:
    """A prefill's fused layer (Q4_K tiles, Q6_K tiles, plain Q8_0 rows side by side), its
    weights dequantized a few rows at a time, equals each segment's own matmul, each in its
    columns, and the dequantized weights' product; a wrong column count is a clear error."""
    k = 512
    kinds = [(T.Q4_K, 24, True), (T.Q6_K, 16, True), (T.Q8_0, 12, False)]
    blocks, qtypes = [], []
    for seed, (qtype, n, x8) in enumerate(kinds):
        raw = torch.from_numpy(random_blocks(qtype, n, k, seed=seed))
        blocks.append(repack_q4x8(raw, qtype) if x8 else raw)
        qtypes.append(int(qtype) + (X8_FLAG if x8 else 0))
    x = torch.randn(70, k).to(dtype)
    ops = torch.ops.minivllm
    fused = ops.ggml_dequant_matmul_kinds(x, blocks, torch.tensor(qtypes), 52, 5)
    parts = [ops.ggml_dequant_matmul(x, b, q, 5) for b, q in zip(blocks, qtypes)]
    assert fused.dtype == dtype and torch.equal(fused, torch.cat(parts, dim=1))
    dense = torch.cat(
        [ops.ggml_dequantize(b, q, k, torch.float32, 0) for b, q in zip(blocks, qtypes)]
    )
    torch.testing.assert_close(
        fused.float(), x.float() @ dense.to(dtype).float().T, rtol=2e-2, atol=5e-2
    )
    with pytest.raises(RuntimeError, match="give 52 output columns, not 50"):
        ops.ggml_dequant_matmul_kinds(x, blocks, torch.tensor(qtypes), 50, 5)
