"""One sequence's decode rate through the public API: what a single user waits for per token.

`LLM.generate` of one random 64-token prompt, timed for 1 and for 257 new tokens; the
difference over 256 is the milliseconds per decoded token, engine loop included (scheduling,
the compiled step, the LM head, sampling, detokenizing), unlike `decode_profile.py`, which
times engine steps. Prints one figure per round.

    .venv/bin/python benchmarks/single_stream.py [--rounds 3] [--dtype auto] [--model FILE]
        [--llama-bench ~/.cache/minivllm/llama.cpp/build-*/bin/llama-bench]

With `--llama-bench` (and a GGUF `--model`) each round also runs llama.cpp's `llama-bench` on
the same file (`-p 0 -n 256`, torch's thread count): its decode alone, no HTTP on either side.
The two take turns, so a host whose speed drifts between minutes slows both alike; each
round prints both and their ratio, the last line the median ratio. Then our drafts are off
(`llama-bench` has none) and our sampling greedy unless `--temperature` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.config import SPECULATION_OFF


def llama_bench_ms(bench: str, model: str, tokens: int) -> float:
    """llama-bench's milliseconds per decoded token on `model` (one run of `tokens`)."""
    out = subprocess.run(
        [bench, "-m", model, "-t", str(torch.get_num_threads()), "-p", "0", "-n", str(tokens)]
        + ["-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{bench} failed on {model}: {out.stderr.strip()[-500:]}")
    return 1e3 / json.loads(out.stdout)[0]["avg_ts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="a model path or GGUF (default: ours)")
    parser.add_argument("--llama-bench", default=None, metavar="PATH")
    parser.add_argument("--temperature", type=float, default=None, help="0.6; 0 with llama")
    args = parser.parse_args()
    if args.llama_bench and not args.model:
        parser.error("--llama-bench needs --model (the GGUF both engines run)")
    if args.llama_bench and not os.access(args.llama_bench, os.X_OK):
        parser.error(f"--llama-bench {args.llama_bench}: not an executable file")
    peer = args.llama_bench is not None
    temperature = args.temperature if args.temperature is not None else (0.0 if peer else 0.6)
    options = {"speculative_config": SPECULATION_OFF} if peer else {}
    llm = LLM(args.model, dtype=args.dtype, **options)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(64)]}

    def generate(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(
            [prompt],
            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature),
            use_tqdm=False,
        )
        return time.perf_counter() - start

    generate(8)  # warm-up
    ratios = []
    for _ in range(args.rounds):
        one, many = generate(1), generate(257)
        ours = (many - one) / 256 * 1e3
        if not peer:
            print(f"one sequence: {ours:.2f} ms per decoded token")
            continue
        theirs = llama_bench_ms(args.llama_bench, args.model, 256)
        ratios.append(theirs / ours)
        print(
            f"one sequence: {ours:.2f} ms per decoded token, llama-bench {theirs:.2f}: "
            f"{ratios[-1]:.2f}x its rate",
            flush=True,
        )
    if ratios:
        print(f"median over {len(ratios)} rounds: {statistics.median(ratios):.2f}x llama-bench")


if __name__ == "__main__":
    main()
