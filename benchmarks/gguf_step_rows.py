"""The linear layers of one step of a GGUF model, as its stored blocks run them, at M rows.

Reads every layer's q/k/v, output, gate/up and down tensors and the LM head (the token
embedding when tied) straight from the file and times `ggml_matmul_segments` over them on
random activations of M rows: the matmul cost of one decode step of M sequences, or of one
sequence verifying M - 1 speculative drafts. Prints the best of `--rounds` in wall and CPU
milliseconds per M, and each M's cost against M=1.

    .venv/bin/python benchmarks/gguf_step_rows.py FILE.gguf --rows 1 2 5 16
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGML_QUANT_SIZES

from minivllm.layers.quantization.kernels.ggml_blocks import ggml_matmul_segments
from minivllm.models.gguf_file import GGUFFile

FUSED = (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"])


def step_layers(path: str) -> list[list[tuple[torch.Tensor, object]]]:
    """Each linear layer of one step as its segments `(blocks, qtype)`, the LM head last."""
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    layers = []
    i = 0
    while f"blk.{i}.attn_q.weight" in tensors:
        for names in FUSED:
            found = [tensors[f"blk.{i}.{name}.weight"] for name in names]
            layers.append([(torch.from_numpy(t.data), t.tensor_type) for t in found])
        i += 1
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    layers.append([(torch.from_numpy(head.data), head.tensor_type)])
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file whose linear tensors are K-quant or Q8_0")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    layers = step_layers(args.model)
    base = None
    for m in args.rows:
        inputs: dict[int, torch.Tensor] = {}
        best_wall = best_cpu = float("inf")
        for _ in range(args.rounds + 1):  # the first round pages the weights in
            wall, cpu = time.perf_counter(), time.process_time()
            for segments in layers:
                elems, nbytes = GGML_QUANT_SIZES[segments[0][1]]
                k = segments[0][0].shape[1] // nbytes * elems
                ggml_matmul_segments(inputs.setdefault(k, torch.randn(m, k)), segments)
            best_wall = min(best_wall, time.perf_counter() - wall)
            best_cpu = min(best_cpu, time.process_time() - cpu)
        base = base or best_wall
        print(
            f"M={m:>3}: {best_wall * 1e3:7.1f} ms wall, {best_cpu * 1e3:7.1f} ms CPU "
            f"({torch.get_num_threads()} threads): {best_wall / base:.2f}x M={args.rows[0]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
