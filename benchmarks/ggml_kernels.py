"""The GGUF block kernels (`minivllm.layers.quantization.kernels.ggml_blocks`) against the
dense and packed paths, at Llama-3.2-1B's linear shapes, per row count M and thread count.

For each weight shape (K inputs -> N outputs: 2048 -> 2048 for attention, 2048 -> 8192 for the
MLP's gate and up, 8192 -> 2048 for its down) and each M it times, in microseconds per call
and in GB/s of weight bytes read (the bytes of the weight as that path stores it, over the
call's time):

- `dense fp32` / `dense bf16`: `F.linear` on a dense weight (what a dequantized model runs);
- `ggml Q4_K`, `ggml Q6_K`, `ggml Q8_0`, `ggml Q5_0`: `ggml_matmul` on the raw blocks (fp32
  activations, int8-quantized inside), the path for decode-sized steps of weights that are
  not moved into tiles;
- `dequant Q4_K fp32` / `bf16`, `dequant Q8_0 bf16`: `dequant_matmul` (tile-by-tile
  dequantization into a scratch buffer in x's dtype, then torch's matmul), the path for
  prefill-sized steps;
- `ggml Q4_1`: `ggml_matmul` on Q4_1 blocks as the file stores them; `ggml Q4_1 x8`: the
  same bytes in tiles of 8 rows (`repack_q4x8`, two int8 codes an activation), the path
  Q4_0/Q4_1 weights take; `ggml Q4_K x8`, `ggml Q6_K x8`, `ggml Q8_0 x8`, `ggml Q5_0 x8`:
  those kinds in tiles of 8 rows (Q5_0's codes a byte each; `... x8 avx2`: the same tiles on
  the AVX2 kernel, where the VNNI one runs), the path they take;
- `qgemv 4-bit`: our earlier kernel on repacked Q4_1-like groups of 32 (fp32 activations);
- `int4 bf16`: torch's packed int4 kernel (bf16 activations).

Each kind is timed over enough distinct copies of the weight (cycled) that they stream from
memory, not from cache; the best of three rounds is kept, in CPU time (the machine may be
shared). Run:

    .venv/bin/python benchmarks/ggml_kernels.py                      # torch's best kernels
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/ggml_kernels.py   # the AVX2 paths
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.kernels.ggml_blocks import (
    X8_FLAG,
    available_isas,
    dequant_matmul,
    ggml_matmul,
    repack_q4x8,
)
from minivllm.layers.quantization.kernels.int4 import PackedInt4, quantize_int4
from minivllm.layers.quantization.kernels.qgemv import QGemvWeight

T = GGMLQuantizationType
SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048)]  # (K inputs, N outputs)
STREAM_BYTES = 192 << 20  # copies of a weight cycled per kind: at least this many bytes


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """`[n, row_bytes]` blocks with random codes and small finite fp16 scales (timing only)."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    scales = (rng.random((n, k // elems, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    at = {T.Q6_K: 208}.get(qtype, 0)
    blocks[..., at : at + 2] = scales[..., :2]
    if qtype in (T.Q4_K, T.Q4_1):
        blocks[..., 2:4] = scales[..., 2:]
    return torch.from_numpy(blocks.reshape(n, -1))


def segments_op() -> Callable:
    """The fused-segments operator, which takes x8 tiles (the kernels must have loaded)."""
    return torch.ops.minivllm.ggml_matmul_segments


def copies_of(make: Callable[[], object], nbytes: int) -> list:
    return [make() for _ in range(max(2, min(16, -(-STREAM_BYTES // nbytes))))]


def kernels(k: int, n: int, rows: int) -> dict[str, tuple[Callable[[], object], int]]:
    """`{name: (call, weight bytes)}`, each call on the next copy of its weight."""
    rng = np.random.default_rng(0)
    x32, x16 = torch.randn(rows, k), torch.randn(rows, k).bfloat16()
    found: dict[str, tuple[Callable[[], object], int]] = {}

    def add(name: str, weights: list, nbytes: int, call: Callable[[object], object]) -> None:
        state = {"i": 0}

        def run() -> object:
            state["i"] = (state["i"] + 1) % len(weights)
            return call(weights[state["i"]])

        found[name] = (run, nbytes)

    dense = torch.randn(n, k) * 0.02
    add("dense fp32", copies_of(dense.clone, n * k * 4), n * k * 4, lambda w: F.linear(x32, w))
    add(
        "dense bf16",
        copies_of(lambda: dense.bfloat16(), n * k * 2),
        n * k * 2,
        lambda w: F.linear(x16, w),
    )
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0):
        if k % GGML_QUANT_SIZES[qtype][0]:  # SmolLM2's 576 inputs: no K-quant rows
            continue
        nbytes = n * k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
        blocks = copies_of(lambda q=qtype: random_blocks(q, n, k, rng), nbytes)
        add(f"ggml {qtype.name}", blocks, nbytes, lambda w, q=qtype: ggml_matmul(x32, w, q))
        tiles = [repack_q4x8(w, qtype) for w in blocks]
        tile_bytes = sum(t.numel() for t in tiles) // len(tiles)  # Q5_0's: a byte a code
        x8_k = int(qtype) + X8_FLAG
        add(
            f"ggml {qtype.name} x8",
            tiles,
            tile_bytes,
            lambda w, q=x8_k: segments_op()(x32, [w], [q], 0),
        )
        if "avx512_vnni" in available_isas():  # the same tiles on the AVX2 kernel
            add(
                f"ggml {qtype.name} x8 avx2",
                tiles,
                tile_bytes,
                lambda w, q=x8_k: segments_op()(x32, [w], [q], 2),
            )
        if qtype == T.Q8_0:
            add("dequant Q8_0 bf16", blocks, nbytes, lambda w: dequant_matmul(x16, w, T.Q8_0))
        if qtype == T.Q4_K:
            add("dequant Q4_K fp32", blocks, nbytes, lambda w: dequant_matmul(x32, w, T.Q4_K))
            add("dequant Q4_K bf16", blocks, nbytes, lambda w: dequant_matmul(x16, w, T.Q4_K))
    nbytes = n * k // 32 * 20
    q4_1 = copies_of(lambda: random_blocks(T.Q4_1, n, k, rng), nbytes)
    add("ggml Q4_1", q4_1, nbytes, lambda w: ggml_matmul(x32, w, T.Q4_1))
    x8 = [repack_q4x8(w, T.Q4_1) for w in q4_1]
    x8_type = int(T.Q4_1) + X8_FLAG
    add("ggml Q4_1 x8", x8, nbytes, lambda w: segments_op()(x32, [w], [x8_type], 0))
    int4 = quantize_int4(dense)
    add(
        "qgemv 4-bit",
        copies_of(lambda: QGemvWeight.from_int4(int4), n * k * 5 // 8),
        n * k * 5 // 8,
        lambda w: w.matmul(x32),
    )
    add(
        "int4 bf16",
        copies_of(lambda: PackedInt4(int4), n * k * 5 // 8),
        n * k * 5 // 8,
        lambda w: w.matmul(x16),
    )
    return found


def timed(fn: Callable[[], object], budget_s: float, threads: int) -> float:
    """Best seconds per call of three rounds of about `budget_s / 3` each, in CPU time over
    the threads (the process's CPU time / threads: on a shared machine the wall clock is its
    load; this assumes the work splits evenly, which it does here up to a few percent)."""
    start = time.process_time()
    fn()
    once = max((time.process_time() - start) / threads, 1e-6)
    repeats = max(1, int(budget_s / 3 / once))
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.process_time() - start) / threads / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=[f"{k}x{n}" for k, n in SHAPES],
        help="KxN weight shapes (default: Llama-3.2-1B's; SmolLM2-135M's: 576x3072 1536x576)",
    )
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the block kernels do not run here (they need x86 with AVX2)")
    print(
        f"torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}, "
        f"ggml paths {available_isas()}"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        for k, n in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes):
            for rows in args.rows:
                print(f"\n{threads} thread(s), K {k} -> N {n}, M {rows}")
                for name, (fn, nbytes) in kernels(k, n, rows).items():
                    seconds = timed(fn, args.budget, threads)
                    gbps = nbytes / seconds / 1e9
                    print(f"  {name:18s} {seconds * 1e6:10.0f} us {gbps:7.1f} GB/s")


if __name__ == "__main__":
    main()
