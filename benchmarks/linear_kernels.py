"""The linear layers' kernels side by side at SmolLM2-135M's shapes, per row count.

For each row count M (tokens in the step) it times one decoder layer's four projections
(qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576) and the LM head (576->49152)
with: dense fp32, dense bf16 (`F.linear`, and prepacked for oneDNN as the engine runs it,
`minivllm.layers.quantization.kernels.onednn`), and torch's packed int4 weights (groups of
32, a scale and a zero each) with bf16 activations (with fp32 activations the kernel is scalar on
x86, 8-100x slower than dense fp32 in a first run here, so it is left out), and for the LM head
(Q8_0 in the default model's file) "int8 pair": two int4 calls, the 8-bit weight split in 4-bit
halves (`minivllm.layers.quantization.kernels.int4.split_int8`, `int8_as_int4_pair`); and our qgemv
kernel (`minivllm.layers.quantization.kernels.qgemv`: fp32 activations, 4-bit weights, or the Q8_0
head's 8-bit ones), the fp32 path of AVX2-only CPUs. It prints microseconds per call and the
speed-up over fp32, from which the `int4` row threshold (packed int4 at or below it, dense bf16
above) and the `qgemv` one of `minivllm.layers.quantization.rows.KERNEL_ROWS` are chosen for each
CPU kind. Columns a CPU cannot run (oneDNN bf16 on an AVX2-only CPU) are left out. The layer's
shapes are timed over `--layers` distinct copies (default 30, SmolLM2's depth) so that their weights
stream from memory as in the model, not from cache. Run it on each CPU kind:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_kernels.py
    OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/linear_kernels.py
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.kernels.int4 import quantize_int4, split_int8
from minivllm.layers.quantization.kernels.onednn import OneDnnWeight, onednn_prepack_supported
from minivllm.layers.quantization.kernels.qgemv import QGemvWeight

SHAPES = {"layer": [(960, 576), (576, 576), (3072, 576), (576, 1536)], "lm_head": [(49152, 576)]}
GROUP = 32
INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu


def timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.process_time()  # CPU time: the shared machine's wall clock is its load
        for _ in range(repeats):
            fn()
        best = min(best, (time.process_time() - start) / repeats)
    return best * 1e6


def kernels(shapes: list[tuple[int, int]], rows: int):
    """`{name: callable}` running every shape once per call."""
    fns: dict[str, list] = {
        "fp32": [],
        "bf16": [],
        "bf16 oneDNN": [],
        "int4 bf16": [],
        "qgemv fp32": [],
    }
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.rand(k // GROUP, n, 2) * 0.01  # [K/G, N, (scale, zero)]
        x32 = torch.randn(rows, k)
        x16, w16, sz16 = x32.bfloat16(), w.bfloat16(), sz.bfloat16()
        fns["fp32"].append(lambda x=x32, w=w: torch.nn.functional.linear(x, w))
        fns["bf16"].append(lambda x=x16, w=w16: torch.nn.functional.linear(x, w))
        if onednn_prepack_supported(w16):
            prepacked = OneDnnWeight(w16)
            fns["bf16 oneDNN"].append(lambda x=x16, w=prepacked: w.matmul(x))
        fns["int4 bf16"].append(lambda x=x16, p=packed, s=sz16: INT4_MM(x, p, GROUP, s))
        if cpu_kernels_available():
            if n == SHAPES["lm_head"][0][0]:  # the Q8_0 head: 8-bit codes
                codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
                qw = QGemvWeight.from_int8_halves(*split_int8(codes, sz[..., 0].t().float()))
            else:
                qw = QGemvWeight.from_int4(quantize_int4(w))
            fns["qgemv fp32"].append(lambda x=x32, w=qw: w.matmul(x))
        if n == SHAPES["lm_head"][0][0]:
            fns.setdefault("int8 pair", []).append(
                lambda x=x16, p=packed, s=sz16: (
                    INT4_MM(x, p, GROUP, s).float() + INT4_MM(x, p, GROUP, s).float()
                )
            )
    return {name: (lambda fs=fs: [f() for f in fs]) for name, fs in fns.items() if fs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument(
        "--layers",
        type=int,
        default=30,
        help="distinct copies of the layer's weights, so that they stream from "
        "memory as a whole model's do (SmolLM2 has 30); 1: cache-hot",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; us per call (speed-up over fp32)"
    )
    with torch.inference_mode():
        for part, shapes in SHAPES.items():
            copies = args.layers if part == "layer" else 1
            for rows in args.rows:
                repeats = max(2, 40 // rows)
                fns = kernels(shapes * copies, rows)
                times = {name: timed(fn, repeats) / copies for name, fn in fns.items()}
                cells = ", ".join(
                    f"{name} {t:8.0f} ({times['fp32'] / t:4.1f}x)" for name, t in times.items()
                )
                print(f"{part:>7} M={rows:<4} {cells}", flush=True)


if __name__ == "__main__":
    main()
