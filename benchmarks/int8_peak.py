"""How close the K-quant matmul runs to this CPU's ceiling for integer dot products, and how
close llama.cpp's does: the bound on any prefill or batched-decode speed-up over llama.cpp.

A 4-bit K-quant weight times 8-bit activations costs, per 32 products of one group, one
`vpmaddubsw` (unsigned codes times signed activations, pairs summed in int16) and one
`vpmaddwd` by the group's scale (into int32), then an add: llama.cpp's AVX2 kernels and ours
both do this. A tiny C++ loop (compiled here with g++) times exactly that sequence with enough
independent accumulators to hide its latency, giving the CPU's peak in multiply-adds (MACs)
per second on one thread; a second loop times fp32 FMA, the peak of a dequantize-then-sgemm
path; on an AVX-512 VNNI CPU two more time `vpdpbusd` (4 products a lane into int32, the VNNI
kernels' one instruction) on 256 and 512 bits. Then the engine's Q4_K kernel (x8 tiles) at
Llama-3.2-1B's MLP shape (2048 -> 8192) with M activation rows is timed on one thread, on each
path (`--isa`), against that path's peak, and, with `--llama-bench`, llama.cpp's pp512 on a
Q4_K_M file (one thread) is converted to MACs per second with the file's parameter count.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/int8_peak.py --rows 1 16 128 512 \\
        [--isa avx2 avx512_vnni] [--llama-bench PATH --model FILE.gguf]
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
# VNNI's one instruction for 4 products a lane summed into int32, as the x8 tiles' kernels run
# it: 256 bits (a tile at a time) and 512 (two tiles side by side; a Zen 4 runs those in two
# passes), the broadcast activation from L1.
VNNI_BODIES = {
    reg: "".join(f"vpdpbusd {32 * j}(%[p]), %%{reg}0, %%{reg}{6 + j}\n" for j in range(10))
    for reg in ("ymm", "zmm")
}
CLOBBERS = ", ".join(f'"xmm{i}"' for i in range(16))


def _timed_loop(name: str, body: str, macs_per_pass: int, reg: str = "ymm") -> str:
    """A C++ function `double name(long iters)`: `body` (assembly) `iters` times, returning
    multiply-adds per second; `reg` the registers' width."""
    xor = "vpxor" if reg == "ymm" else "vpxord"
    zero = "".join(f"{xor} %%{reg}{6 + j}, %%{reg}{6 + j}, %%{reg}{6 + j}\\n" for j in range(10))
    load = "vmovdqu" if reg == "ymm" else "vmovdqu64"
    lines = "".join(f'"{line}\\n"' for line in body.splitlines())
    return f"""
double {name}(long iters) {{
  long n = iters;
  auto start = std::chrono::steady_clock::now();
  asm volatile("{load} (%[c]), %%{reg}0\\n" "vmovdqu 64(%[c]), %%ymm1\\n" "{zero}"
    "1:\\n" {lines} "dec %[n]\\n" "jnz 1b\\n"
    : [n] "+r"(n) : [p] "r"(data), [c] "r"(consts) : {CLOBBERS}, "memory", "cc");
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {macs_per_pass}.0 * iters / s;
}}
"""


def _source(vnni: bool) -> str:
    """The loops and a main printing each one's best of three as JSON (VNNI's with `vnni`)."""
    loops = {"int8_macs": ("int8_loop", INT8_BODY, 32 * 10, "ymm")}  # a maddubs: 32 MACs
    loops["fp32_macs"] = ("fma_loop", FMA_BODY, 8 * 10, "ymm")  # an FMA: 8
    if vnni:  # a vpdpbusd: 32 MACs on 256 bits, 64 on 512
        loops["vnni256_macs"] = ("vnni256_loop", VNNI_BODIES["ymm"], 32 * 10, "ymm")
        loops["vnni512_macs"] = ("vnni512_loop", VNNI_BODIES["zmm"], 64 * 10, "zmm")
    functions = "".join(_timed_loop(name, body, m, reg) for name, body, m, reg in loops.values())
    timings = "".join(
        f"  {{ double best = 0; for (int r = 0; r < 3; ++r) {{ double v = {name}(iters); "
        f'best = v > best ? v : best; }} std::printf("%s\\"{key}\\": %.6e", sep, best); '
        f'sep = ", "; }}\n'
        for key, (name, *_) in loops.items()
    )
    return (
        """
#include <chrono>
#include <cstdio>
#include <cstdlib>

alignas(64) static unsigned char data[10 * 32 + 64];
alignas(64) static short consts[64];
"""
        + functions
        + """
int main(int argc, char** argv) {
  for (int i = 0; i < 10 * 32 + 64; ++i) data[i] = static_cast<unsigned char>(i % 16);
  for (int i = 0; i < 64; ++i) consts[i] = 3;
  long iters = argc > 1 ? std::atol(argv[1]) : 50000000;
  const char* sep = "";
  std::printf("{");
"""
        + timings
        + """  std::printf("}\\n");
}
"""
    )


LLAMA_1B_MLP = (2048, 8192)  # (K inputs, N outputs)


def _has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (Linux's /proc/cpuinfo flags)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512_vnni" in cpuinfo.read_text().split()


def cpu_peaks(iterations: int) -> dict[str, float]:
    """{'int8_macs', 'fp32_macs'} (and 'vnni256_macs', 'vnni512_macs' where the CPU has
    AVX-512 VNNI): one thread's best multiply-adds per second."""
    vnni = _has_vnni()
    flags = ["-mavx2", "-mfma"] + (["-mavx512f", "-mavx512vl", "-mavx512vnni"] if vnni else [])
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        source.write_text(_source(vnni))
        subprocess.run(["g++", "-O3", *flags, "-o", str(binary), str(source)], check=True)
        out = subprocess.run([str(binary), str(iterations)], capture_output=True, text=True)
    return json.loads(out.stdout)


def kernel_macs(rows: int, budget_s: float, isa: str) -> float:
    """Multiply-adds per second of the Q4_K kernel the engine runs (x8 tiles, on `isa`) at
    Llama-3.2-1B's MLP shape with `rows` activation rows, one thread, best of three in CPU
    time."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from minivllm.layers.cpu_kernels import cpu_kernels_available
    from minivllm.layers.quantization.kernels.ggml_blocks import ISAS, X8_FLAG, repack_q4x8

    if not cpu_kernels_available():
        raise SystemExit("int8_peak.py: the C++ kernels did not build here (see the log above)")

    torch.set_num_threads(1)
    k, n = LLAMA_1B_MLP
    qtype = GGMLQuantizationType.Q4_K
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    blocks[..., 0:4] = (
        (rng.random((n, k // elems, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    )
    tiles = repack_q4x8(torch.from_numpy(blocks.reshape(n, -1)), qtype)
    kinds, code = [int(qtype) + X8_FLAG], ISAS[isa]
    x = torch.randn(rows, k)
    torch.ops.minivllm.ggml_matmul_segments(x, [tiles], kinds, code)
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.process_time()
        while time.process_time() - start < budget_s / 3:
            torch.ops.minivllm.ggml_matmul_segments(x, [tiles], kinds, code)
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
    parser.add_argument(
        "--isa",
        nargs="+",
        choices=["avx2", "avx512_vnni"],
        default=None,
        help="the kernel's paths (default: avx2, and avx512_vnni where it runs)",
    )
    parser.add_argument("--llama-bench", default=None, metavar="PATH")
    parser.add_argument("--model", default=None, help="a Q4_K_M .gguf for --llama-bench")
    args = parser.parse_args()
    peaks = cpu_peaks(args.iterations)
    # each path's ceiling: its own instructions' rate (VNNI's best width where it runs)
    vnni_peak = max(peaks.get("vnni256_macs", 0.0), peaks.get("vnni512_macs", 0.0))
    ceilings = {"avx2": peaks["int8_macs"], "avx512_vnni": vnni_peak}
    if "avx512_vnni" in (args.isa or []) and not vnni_peak:
        parser.error("--isa avx512_vnni: this CPU has no AVX-512 VNNI")
    print(f"one thread: int8 maddubs+madd peak {peaks['int8_macs'] / 1e9:.1f} GMAC/s, ", end="")
    print(f"fp32 FMA peak {peaks['fp32_macs'] / 1e9:.1f} GMAC/s")
    if vnni_peak:
        print(f"  vpdpbusd peak: {peaks['vnni256_macs'] / 1e9:.1f} GMAC/s on 256 bits, ", end="")
        print(f"{peaks['vnni512_macs'] / 1e9:.1f} on 512")
    for isa in args.isa or ["avx2"] + ["avx512_vnni"] * bool(vnni_peak):
        for rows in args.rows:
            macs, peak = kernel_macs(rows, args.budget, isa), ceilings[isa]
            print(
                f"Q4_K x8 tiles on {isa}, M={rows:4d}: {macs / 1e9:6.1f} GMAC/s = "
                f"{macs / peak:5.1%} of its peak"
            )
    if args.llama_bench and args.model:
        peak = max(ceilings.values())
        macs = llama_pp512_macs(args.llama_bench, args.model)
        print(f"llama.cpp pp512: {macs / 1e9:6.1f} GMAC/s = {macs / peak:5.1%} of the int8 peak")
        print(f"  a prefill ratio over it cannot pass {peak / macs:.2f}x on this CPU's int8 path")


if __name__ == "__main__":
    main()
