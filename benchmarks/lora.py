"""Decode speed with LoRA adapters against the base model, side by side in one engine.

One engine with `enable_lora` (the default model unless `--model`); four random PEFT adapters
(rank `--rank` on q/k/v/o and gate/up/down of every layer) written to a temporary folder. Each
round (interleaved, `--rounds` times: the machine is shared and noisy) runs `c` prompts on the
base model, then the same prompts spread over the four adapters (c/4 each, mixed in every
step), and prints decode tok/s of each and the ratio of the best mixed to the best base, by
the wall clock and by the process's CPU time (tokens per CPU second of all its threads: a
shared VM's stolen time does not count, so this ratio moves less between runs).

    python benchmarks/lora.py --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from minivllm import LLM, LoRARequest, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(llm: LLM, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter for every attention and MLP projection of the loaded model."""
    manager = llm.llm_engine.model_runner.lora
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (hook, i, layer) in manager.targets.items():
        rows = hook.out_splits[i]
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, layer.input_size, generator=gen)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def decode_rate(llm: LLM, prompts: list[list[int]], loras: list, new: int) -> tuple[float, float]:
    """Decode tok/s of the prompts (prefilled first, untimed, then served from the cache), by
    the wall clock and per CPU second."""
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), False, loras)
    params = SamplingParams(max_tokens=1 + new, temperature=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    tokens = len(prompts) * new
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new", type=int, default=32, help="decoded tokens per sequence")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=args.rank,
        max_model_len=args.context + args.new + 16,
        max_num_seqs=args.concurrency,
    )
    rng = random.Random(0)
    vocab = llm.llm_engine.model_runner.vocab_size
    c = args.concurrency
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.context)] for _ in range(c)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"a{i}", i, str(write_adapter(llm, Path(tmp) / f"a{i}", args.rank, i)))
            for i in range(1, 5)
        ]
        mixed = [adapters[i % 4] for i in range(c)]
        best = {"base": [0.0, 0.0], "4 adapters": [0.0, 0.0]}  # [wall, cpu]
        for round_ in range(args.rounds):
            for kind, loras in (("base", [None] * c), ("4 adapters", mixed)):
                wall, cpu = decode_rate(llm, prompts, loras, args.new)
                best[kind] = [max(best[kind][0], wall), max(best[kind][1], cpu)]
                print(f"round {round_} {kind:>10} c={c}: {wall:.1f} tok/s, {cpu:.1f} tok/CPU-s")
    base, mixed_best = best["base"], best["4 adapters"]
    print(
        f"best: base {base[0]:.1f} tok/s, 4 adapters {mixed_best[0]:.1f} tok/s, ratio "
        f"{mixed_best[0] / base[0]:.2f}x; per CPU second {base[1]:.1f} and {mixed_best[1]:.1f}, "
        f"ratio {mixed_best[1] / base[1]:.2f}x"
    )


if __name__ == "__main__":
    main()
