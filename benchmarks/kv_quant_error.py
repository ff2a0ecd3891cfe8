"""int8 KV scales, per token and KV head against per block and KV head, on a model's real K/V.

It runs the model (default: the default model, `auto` cache) over `bench quality`'s text,
reads back every layer's cached K and V rows, and quantizes them both ways (symmetric int8,
the largest magnitude -> 127): the relative RMS error of each, for K and for V, and the
bits a value costs with a float32 scale.

    python benchmarks/kv_quant_error.py
"""

from __future__ import annotations

import argparse

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.quality import QUALITY_TEXT


def relative_error(rows: torch.Tensor, group: int) -> float:
    """`rows` `[tokens, KVH, D]`: the RMS error over the RMS value of int8 with one scale per
    `group` consecutive tokens of a head (1: per token)."""
    tokens = rows.shape[0] - rows.shape[0] % group
    x = rows[:tokens].float().view(tokens // group, group, *rows.shape[1:])  # [B, G, KVH, D]
    scale = (x.abs().amax(dim=(1, 3), keepdim=True) / 127).clamp_min(1e-8)  # [B, 1, KVH, 1]
    error = (torch.round(x / scale).clamp(-127, 127) * scale - x).pow(2).mean().sqrt()
    return float(error / x.pow(2).mean().sqrt())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, enforce_eager=True, num_kv_blocks=64)
    ids = llm.llm_engine.tokenizer.encode(QUALITY_TEXT)
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    runner = llm.llm_engine.model_runner
    block = runner.block_size
    used = (len(ids) // block) * block
    # one prompt on an empty pool: its positions went to the first blocks' slots, in order
    head_dim = runner.head_dim
    for name, which in (("K", 0), ("V", 1)):
        rows = torch.cat(
            [kv[which].view(-1, runner.num_kv_heads, head_dim)[:used] for kv in runner.kv_caches]
        )
        per_token, per_block = relative_error(rows, 1), relative_error(rows, block)
        print(
            f"{name}: relative RMS error, scale per token and head {100 * per_token:.2f}% "
            f"({8 + 32 / head_dim:.2f} bits a value); per {block}-token block and head "
            f"{100 * per_block:.2f}% ({8 + 32 / (head_dim * block):.2f} bits); "
            f"largest magnitude {rows.abs().max().item():.1f}"
        )


if __name__ == "__main__":
    main()
