"""How close the K-quant matmul runs to this CPU's ceiling for integer dot products, and how
close llama.cpp's does: the bound on any prefill or batched-decode speed-up over llama.cpp.

A 4-bit K-quant weight times 8-bit activations costs, per 32 products of one group, one
`vpmaddubsw` (unsigned codes times signed activations, pairs summed in int16) and one
`vpmaddwd` by the group's scale (into int32), then an add: llama.cpp's AVX2 kernels and ours
both do this. A tiny C++ loop (compiled here with g++) times exactly that sequence with enough
independent accumulators to hide its latency, giving the CPU's peak in multiply-adds (MACs)
per second on one thread; a second loop times fp32 FMA, the peak of a dequantize-then-sgemm
path. Then `ggml_matmul` on Q4_K weights at Llama-3.2-1B's MLP shape (2048 -> 8192) with M
activation rows is timed on one thread, and, with `--llama-bench`, llama.cpp's pp512 on a
Q4_K_M file (one thread) is converted to MACs per second with the file's parameter count.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/int8_peak.py --rows 16 128 512 \\
        [--llama-bench PATH --model FILE.gguf]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

# The loops are written in assembly: compilers spill and reorder such loops, and this is a
# measurement of the instructions, not of a compiler. Ten accumulators (ymm6..ymm15) hide the
# latency; one operand comes from L1 as a kernel's activations do.
INT8_BODY = "".join(
    f"vpmaddubsw {32 * j}(%[p]), %%ymm0, %%ymm{2 + j % 4}\n"
    f"vpmaddwd %%ymm1, %%ymm{2 + j % 4}, %%ymm{2 + j % 4}\n"
    f"vpaddd %%ymm{2 + j % 4}, %%ymm{6 + j}, %%ymm{6 + j}\n"
    for j in range(10)
)
FMA_BODY = "".join(f"vfmadd231ps {32 * j}(%[p]), %%ymm1, %%ymm{6 + j}\n" for j in range(10))
CLOBBERS = ", ".join(f'"xmm{i}"' for i in range(16))


def _timed_loop(name: str, body: str, macs_per_pass: int) -> str:
    """A C++ function `double name(long iters)`: `body` (assembly) `iters` times, returning
    multiply-adds per second."""
    zero = "".join(f"vpxor %%ymm{6 + j}, %%ymm{6 + j}, %%ymm{6 + j}\\n" for j in range(10))
    lines = "".join(f'"{line}\\n"' for line in body.splitlines())
    return f"""
double {name}(long iters) {{
  long n = iters;
  auto start = std::chrono::steady_clock::now();
  asm volatile("vmovdqu (%[c]), %%ymm0\\n" "vmovdqu 32(%[c]), %%ymm1\\n" "{zero}"
    "1:\\n" {lines} "dec %[n]\\n" "jnz 1b\\n"
    : [n] "+r"(n) : [p] "r"(data), [c] "r"(consts) : {CLOBBERS}, "memory", "cc");
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {macs_per_pass}.0 * iters / s;
}}
"""


SOURCE = (
    r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>

alignas(64) static unsigned char data[10 * 32];
alignas(64) static short consts[32];
"""
    + _timed_loop("int8_loop", INT8_BODY, 32 * 10)  # one maddubs = 32 multiply-adds
    + _timed_loop("fma_loop", FMA_BODY, 8 * 10)  # one FMA = 8
    + r"""
int main(int argc, char** argv) {
  for (int i = 0; i < 10 * 32; ++i) data[i] = static_cast<unsigned char>(i % 16);
  for (int i = 0; i < 32; ++i) consts[i] = 3;
  long iters = argc > 1 ? std::atol(argv[1]) : 50000000;
  double best_int = 0, best_fma = 0;
  for (int round = 0; round < 3; ++round) {
    double v = int8_loop(iters), f = fma_loop(iters);
    best_int = v > best_int ? v : best_int;
    best_fma = f > best_fma ? f : best_fma;
  }
  std::printf("{\"int8_macs\": %.6e, \"fp32_macs\": %.6e}\n", best_int, best_fma);
}
"""
)

LLAMA_1B_MLP = (2048, 8192)  # (K inputs, N outputs)


def cpu_peaks(iterations: int) -> dict[str, float]:
    """{'int8_macs', 'fp32_macs'}: one thread's best multiply-adds per second."""
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        source.write_text(SOURCE)
        subprocess.run(
            ["g++", "-O3", "-mavx2", "-mfma", "-o", str(binary), str(source)], check=True
        )
        out = subprocess.run([str(binary), str(iterations)], capture_output=True, text=True)
    return json.loads(out.stdout)


def kernel_macs(rows: int, budget_s: float) -> float:
    """Multiply-adds per second of `ggml_matmul` on Q4_K weights at Llama-3.2-1B's MLP shape
    with `rows` activation rows, one thread, best of three in CPU time."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from minivllm.layers.quantization.kernels.ggml_blocks import ggml_matmul

    torch.set_num_threads(1)
    k, n = LLAMA_1B_MLP
    qtype = GGMLQuantizationType.Q4_K
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    blocks[..., 0:4] = (
        (rng.random((n, k // elems, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    )
    weight = torch.from_numpy(blocks.reshape(n, -1))
    x = torch.randn(rows, k)
    ggml_matmul(x, weight, qtype)
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.process_time()
        while time.process_time() - start < budget_s / 3:
            ggml_matmul(x, weight, qtype)
            calls += 1
        best = min(best, (time.process_time() - start) / calls)
    return rows * k * n / best


def llama_pp512_macs(llama_bench: str, model: str) -> float:
    """llama-bench's pp512 on one thread, as multiply-adds per second of its linear layers
    (the model's parameters without the token embedding, times tokens per second)."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    params = sum(int(t.n_elements) for t in reader.tensors if t.name != "token_embd.weight")
    out = subprocess.run(
        [llama_bench, "-m", model, "-t", "1", "-p", "512", "-n", "0", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    tok_per_s = json.loads(out.stdout)[0]["avg_ts"]
    print(f"llama.cpp pp512, 1 thread: {tok_per_s:.1f} tok/s over {params / 1e9:.2f}B weights")
    return tok_per_s * params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--iterations", type=int, default=50_000_000)
    parser.add_argument("--budget", type=float, default=1.5, help="seconds per kernel timing")
    parser.add_argument("--llama-bench", default=None, metavar="PATH")
    parser.add_argument("--model", default=None, help="a Q4_K_M .gguf for --llama-bench")
    args = parser.parse_args()
    peaks = cpu_peaks(args.iterations)
    peak = peaks["int8_macs"]
    print(f"one thread: int8 maddubs+madd peak {peak / 1e9:.1f} GMAC/s, ", end="")
    print(f"fp32 FMA peak {peaks['fp32_macs'] / 1e9:.1f} GMAC/s")
    for rows in args.rows:
        macs = kernel_macs(rows, args.budget)
        share = macs / peak
        print(f"ggml_matmul Q4_K, M={rows:4d}: {macs / 1e9:6.1f} GMAC/s = {share:5.1%} of peak")
    if args.llama_bench and args.model:
        macs = llama_pp512_macs(args.llama_bench, args.model)
        print(f"llama.cpp pp512: {macs / 1e9:6.1f} GMAC/s = {macs / peak:5.1%} of the int8 peak")
        print(f"  a prefill ratio over it cannot pass {peak / macs:.2f}x on this CPU's int8 path")


if __name__ == "__main__":
    main()
