"""The linear layers of one step of a GGUF model, as its stored blocks run them, at M rows.

Reads every layer's q/k/v, output, gate/up and down tensors and the LM head (the token
embedding when tied) straight from the file and times `ggml_matmul_segments` over them on
random activations of M rows: the matmul cost of one decode step of M sequences, or of one
sequence verifying M - 1 speculative drafts. The weights are in the layout a model loads them
in (x8 tiles where the kind has them and the rows are a multiple of 8; `--stored`: ggml's
rows). Prints the best of `--rounds` in wall and CPU milliseconds per M and kernel, and each
M's cost against the first M of the first kernel. Kernels: the integer one on an instruction
set (`avx2`, `avx512_vnni`, `amx`; `--two-codes`: two 8-bit codes an activation, as a bf16
model's K kinds take them, so 2M integer rows) and `dequant` (the weight dequantized to bf16 a
tile at a time, torch's matmul: a prefill's path; tiles of the engine's `DEQUANT_TILE_BYTES`,
or N MB with `dequant@N`). `--no-head`: the layers alone (a prefill runs the head on its last
rows only).

    .venv/bin/python benchmarks/gguf_step_rows.py FILE.gguf --rows 1 4 16 --isa avx512_vnni amx
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.layers.quantization.kernels.ggml_blocks import (
    DEQUANT_TILE_BYTES,
    ISAS,
    X8_FLAG,
    X8_KINDS,
    available_isas,
    dequant_tile_rows,
    repack_q4x8,
)
from minivllm.models.gguf_file import GGUFFile

FUSED = (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"])


def step_layers(path: str, stored: bool) -> list[list[tuple[torch.Tensor, int, int]]]:
    """Each linear layer of one step as its segments `(blocks, qtype, inputs)`, the LM head last;
    x8 tiles (their qtype plus X8_FLAG) unless `stored`."""
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    layers = []
    i = 0
    while f"blk.{i}.attn_q.weight" in tensors:
        for names in FUSED:
            found = [tensors[f"blk.{i}.{name}.weight"] for name in names]
            layers.append([_as_loaded(t, stored) for t in found])
        i += 1
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    layers.append([_as_loaded(head, stored)])
    return layers


def _as_loaded(tensor, stored: bool) -> tuple[torch.Tensor, int, int]:
    blocks, k = torch.from_numpy(tensor.data), int(tensor.shape[0])
    if stored or tensor.tensor_type not in X8_KINDS or blocks.shape[0] % 8:
        return blocks, int(tensor.tensor_type), k
    return repack_q4x8(blocks, tensor.tensor_type), int(tensor.tensor_type) + X8_FLAG, k


def run(kernel: str, x: torch.Tensor, blocks: list, kinds: list, two_codes: bool) -> None:
    ops, kind_tensor = torch.ops.minivllm, torch.tensor(kinds)
    columns = sum(b.shape[0] * (8 if k >= X8_FLAG else 1) for b, k in zip(blocks, kinds))
    if kernel.startswith("dequant"):  # tiles of DEQUANT_TILE_BYTES, or of "dequant@MB"
        tile_bytes = int(kernel.split("@")[1]) << 20 if "@" in kernel else DEQUANT_TILE_BYTES
        tile_rows = dequant_tile_rows(x.shape[1], 2, tile_bytes)  # bf16 rows, as BlockWeight
        ops.ggml_dequant_matmul_kinds(x.bfloat16(), blocks, kind_tensor, columns, tile_rows)
    else:
        rows = torch.cat([x, x]) if two_codes else x
        ops.ggml_matmul_segments(rows, blocks, kinds, ISAS[kernel])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file whose linear tensors are K-quant or Q8_0")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--isa", nargs="+", default=["auto"], help=f"of {available_isas()}, dequant, dequant@MB"
    )
    parser.add_argument("--two-codes", action="store_true", help="2M integer rows")
    parser.add_argument("--stored", action="store_true", help="ggml's rows, not x8 tiles")
    parser.add_argument("--no-head", action="store_true", help="the layers without the head")
    args = parser.parse_args()
    layers = step_layers(args.model, args.stored)[: -1 if args.no_head else None]
    base = None
    for m in args.rows:
        for isa in args.isa:
            inputs: dict[int, torch.Tensor] = {}
            best_wall = best_cpu = float("inf")
            for _ in range(args.rounds + 1):  # the first round pages the weights in
                wall, cpu = time.perf_counter(), time.process_time()
                for segments in layers:
                    blocks, kinds, ks = map(list, zip(*segments))
                    if ks[0] not in inputs:  # made once, outside the timing (bf16 for dequant)
                        x = torch.randn(m, ks[0])
                        inputs[ks[0]] = x.bfloat16() if isa.startswith("dequant") else x
                    x = inputs[ks[0]]
                    run(isa, x, blocks, kinds, args.two_codes)
                best_wall = min(best_wall, time.perf_counter() - wall)
                best_cpu = min(best_cpu, time.process_time() - cpu)
            base = base or best_wall
            print(
                f"M={m:>3} {isa:>11}: {best_wall * 1e3:7.1f} ms wall, {best_cpu * 1e3:7.1f} ms "
                f"CPU ({torch.get_num_threads()} threads): {best_wall / base:.2f}x the first",
                flush=True,
            )


if __name__ == "__main__":
    main()
