"""One-row decode steps' matmuls as a model runs them: every layer's weights in turn, streamed
from memory, not from cache.

`ggml_kernels.py` times one shape at a time; a decode step instead walks all its layers'
weights once (60 MB of Q4_1 tiles for the default model, more than the cores' caches) and
then the LM head, which evicts them before the next step. This script builds random Q4_1 x8
tiles with the default model's layer shapes (SmolLM2-135M: 30 layers, hidden 576, MLP 1536,
9 / 3 heads of 64), calls `ggml_matmul_segments` on them in the model's order (qkv, o,
gate_up, down) for one bf16 row, reads a 28 MB buffer between steps as the head does, and
prints the ms a step's layer matmuls take (min and median of 7 rounds of 10 steps), then the
Q8_0 head's qgemv (49152 x 576) after the layers' bytes evicted it.

    .venv/bin/python benchmarks/layer_stream.py [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.kernels.ggml_blocks import X8_FLAG, x8_tile_bytes

Q4_1 = 3
HIDDEN, MLP, Q, KV, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152


def tiles(n: int, k: int) -> torch.Tensor:
    """n rows of k inputs as random Q4_1 x8 tiles, their fp16 scales small and finite."""
    tile = torch.randint(0, 256, (n // 8, x8_tile_bytes(Q4_1, k)), dtype=torch.uint8)
    groups = tile.view(n // 8, k // 32, 160)
    groups[:, :, 128:] = 0x10
    groups[:, :, 129::2] = 0x2C  # fp16 0x2C10: about 0.07
    return tile


def timed(step, evict: torch.Tensor) -> tuple[float, float]:
    rounds = []
    for _ in range(7):
        total = 0.0
        for _ in range(10):
            evict.sum(dtype=torch.int32)
            start = time.perf_counter()
            step()
            total += time.perf_counter() - start
        rounds.append(total / 10 * 1e3)
    return min(rounds), statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the block kernels do not run here (they need x86 with AVX2)")
    matmul = torch.ops.minivllm.ggml_matmul_segments
    layers = [
        [
            [tiles(Q, HIDDEN), tiles(KV, HIDDEN), tiles(KV, HIDDEN)],
            [tiles(HIDDEN, Q)],
            [tiles(MLP, HIDDEN), tiles(MLP, HIDDEN)],
            [tiles(HIDDEN, MLP)],
        ]
        for _ in range(LAYERS)
    ]
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    x_mlp = torch.randn(1, MLP, dtype=torch.bfloat16)
    head_codes = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8)
    head_scales = (torch.rand(VOCAB, HIDDEN // 32) * 0.01).half()
    no_mins = torch.empty(0, dtype=torch.half)
    x_head = torch.randn(1, HIDDEN)
    layer_bytes = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)

    def layer_step() -> None:
        for qkv, o, gate_up, down in layers:
            for weights, inputs in ((qkv, x), (o, x), (gate_up, x), (down, x_mlp)):
                matmul(inputs, weights, [Q4_1 + X8_FLAG] * len(weights), 0)

    def head() -> None:
        torch.ops.minivllm.qgemv(x_head, head_codes, head_scales, no_mins, 8)

    for threads in args.threads:
        torch.set_num_threads(threads)
        lo, mid = timed(layer_step, evict=head_codes)
        print(f"{threads} thread(s): layers' matmuls {lo:.2f} ms a step (median {mid:.2f})")
        lo, mid = timed(head, evict=layer_bytes)
        print(f"{threads} thread(s): Q8_0 head       {lo:.2f} ms a step (median {mid:.2f})")


if __name__ == "__main__":
    main()
