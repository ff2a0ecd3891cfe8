"""Write a GGUF with a published model's shapes and random weights, as a user would get one:
an HF checkpoint converted by llama.cpp's own `convert_hf_to_gguf.py` and quantized by its
`llama-quantize`.

    bash benchmarks/build_llama_cpp.sh          # once: llama.cpp's source and tools
    .venv/bin/pip install sentencepiece         # convert_hf_to_gguf.py imports it
    .venv/bin/python benchmarks/real_size_gguf.py llama-3.2-1b OUT_DIR --quant Q4_K_M

The tokenizer is the default model's (SmolLM2's, 49,152 tokens), so the embedding is smaller
than the published model's; every layer has the published shape. Rope scaling is left out
(our GGUF loader refuses Llama-3's `rope_freqs`). Nothing is downloaded but llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# The published configurations, less vocabulary and rope scaling.
SHAPES = {
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
        ),
    ),
    "llama-3.2-3b": (
        "llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
        ),
    ),
}


def llama_cpp_dirs() -> tuple[Path, Path]:
    """(llama.cpp's source tree, its build's bin/), where benchmarks/build_llama_cpp.sh puts
    them."""
    version = os.environ.get("LLAMA_CPP_VERSION", "11434.0.0")
    cache = Path(
        os.environ.get(
            "MINIVLLM_LLAMA_CPP_CACHE", Path.home() / ".cache" / "minivllm" / "llama.cpp"
        )
    )
    src, bin_dir = cache / f"src-{version}", cache / f"build-{version}" / "bin"
    if not (src / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"no llama.cpp source at {src}: run benchmarks/build_llama_cpp.sh first")
    return src, bin_dir


def write_checkpoint(shape: str, out_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from minivllm.models.gguf import gguf_model_dir
    from minivllm.models.paths import default_model_path

    tokenizer_dir = gguf_model_dir(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model_type, shapes = SHAPES[shape]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
        **shapes,
    )
    with torch.device("meta"):  # names and shapes only: an 8B model would not fit in RAM
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes_of = {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    write_random_shards(shapes_of, out_dir)
    config.architectures = [type(model).__name__]  # what the converter reads the kind from
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(
        f"wrote {shape}: {sum(math.prod(s) for s in shapes_of.values()) / 1e9:.2f}B parameters",
        flush=True,
    )


def write_random_shards(
    shapes: dict[str, tuple[int, ...]], out_dir: Path, shard_bytes: int = 2 << 30
) -> None:
    """Random bf16 tensors (norm weights 1, others N(0, 0.02)) in safetensors shards of at
    most `shard_bytes`, with the index transformers reads: one shard in memory at a time."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    size = 0

    def flush() -> None:
        save_file(
            shards[-1],
            str(out_dir / f"part-{len(shards):05d}.safetensors"),
            metadata={"format": "pt"},
        )
        shards[-1] = {}

    for name, shape in shapes.items():
        if "norm" in name:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if size and size + tensor.nbytes > shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        weight_map[name] = len(shards)
        size += tensor.nbytes
    flush()
    index = {
        "metadata": {"total_size": sum(2 * math.prod(s) for s in shapes.values())},
        "weight_map": {n: f"part-{i:05d}.safetensors" for n, i in weight_map.items()},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--quant",
        nargs="*",
        default=["Q4_K_M"],
        help="llama-quantize types to write besides the bf16 GGUF",
    )
    args = parser.parse_args()
    src, bin_dir = llama_cpp_dirs()
    hf_dir = args.out_dir / f"{args.shape}-hf"
    bf16 = args.out_dir / f"{args.shape}-bf16.gguf"
    outputs = {quant: args.out_dir / f"{args.shape}-{quant}.gguf" for quant in args.quant}
    # the converter writes bf16 and Q8_0 itself; other types come from llama-quantize
    direct = {"bf16": bf16} | {q: p for q, p in outputs.items() if q.upper() == "Q8_0"}
    if any(not p.exists() for p in direct.values()):
        if not hf_dir.exists():
            write_checkpoint(args.shape, hf_dir)
        for outtype, path in direct.items():
            if not path.exists():
                subprocess.run(
                    [
                        sys.executable,
                        str(src / "convert_hf_to_gguf.py"),
                        str(hf_dir),
                        "--outtype",
                        outtype.lower(),
                        "--outfile",
                        str(path),
                    ],
                    check=True,
                )
        shutil.rmtree(hf_dir)
    for quant, out in outputs.items():
        if not out.exists():
            if not (bin_dir / "llama-quantize").is_file():
                sys.exit(f"no llama-quantize in {bin_dir}: run benchmarks/build_llama_cpp.sh")
            subprocess.run(
                [str(bin_dir / "llama-quantize"), str(bf16), str(out), quant],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        print(f"{out}: {out.stat().st_size / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
