"""Write a randomly initialised checkpoint with a real model's shapes, for benchmarks.

    python benchmarks/make_random_model.py qwen3-0.6b OUT_DIR [--dtype bfloat16]

No tokenizer is written: benchmarks send token ids. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    # Qwen3-0.6B's published configuration.
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[args.shape])
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out_dir, safe_serialization=True)
    print(
        f"wrote {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        f"parameters, {args.dtype}) to {args.out_dir}"
    )


if __name__ == "__main__":
    main()
