"""Single-stream speed of the CPU paths on the default model: batch-1 decode and prefill.

For each engine configuration (by default: the defaults, i.e. `dtype="auto"` with the GGUF's
4-bit weights packed int4; bf16 with dense weights; the fp32 token-exact path) it loads the
model, then times, best of `--repeats`: one request decoding `--decode-tokens` tokens after a
64-token prompt (batch-1 decode tok/s), and one `--prefill-tokens`-token prompt (prefill tok/s).
It prints each configuration's numbers and its ratio to the fp32 path. Times are the CPU
seconds of the process (`time.process_time`), best of the repeats: on this shared,
oversubscribed machine the wall clock measures the neighbours. Run it with
`OMP_NUM_THREADS=1` there (torch's two-thread barriers stall when the cores are taken), so a
CPU second is a second of one core.

    .venv/bin/python benchmarks/cpu_paths.py
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/cpu_paths.py --configs fp32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_paths.py --configs defaults \
        --model FILE.gguf --llama-bench ~/.cache/minivllm/llama.cpp/build-*/bin/llama-bench

With `--llama-bench` it also measures llama.cpp on the same file in the same CPU seconds of one
thread (`-t 1`): each rate from the difference of two runs' CPU times (children's rusage), so
its load and warm-up cancel out.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import time

from minivllm import LLM, SamplingParams
from minivllm.bench.workloads import Workload

CONFIGS = {
    "defaults": {},
    "bf16 dense": {"dtype": "bfloat16", "quantization": "none"},
    "fp32": {"dtype": "float32"},
}


def llama_cpp_rates(bench: str, model: str, prefill_tokens: int, decode_tokens: int) -> dict:
    """llama-bench's prefill and decode tok/s in CPU seconds of one thread: prefill from a run
    of 3 repetitions less one of 1 (its warm-up prefills once too), decode from a run of
    16 + `decode_tokens` tokens less one of 16."""

    def cpu_s(*flags: str) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(
            [bench, "-m", model, "-t", "1", *flags],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

    p = str(prefill_tokens)
    prefill = cpu_s("-p", p, "-n", "0", "-r", "3") - cpu_s("-p", p, "-n", "0", "-r", "1")
    decode = cpu_s("-p", "0", "-n", str(16 + decode_tokens), "-r", "1") - cpu_s(
        "-p", "0", "-n", "16", "-r", "1"
    )
    return {
        "prefill_tok_per_s": 2 * prefill_tokens / prefill,
        "decode_tok_per_s": decode_tokens / decode,
    }


def measure(
    options: dict, decode_tokens: int, prefill_tokens: int, repeats: int, model: str | None = None
) -> dict:
    start = time.perf_counter()
    llm = LLM(model, num_kv_blocks=256, enable_prefix_caching=False, **options)
    load_s = time.perf_counter() - start
    runner = llm.llm_engine.model_runner
    vocab = runner.vocab_size
    (prompt,), _ = Workload(1, (64, 64), (1, 1), seed=1).make(vocab)
    (long,), _ = Workload(1, (prefill_tokens, prefill_tokens), (1, 1), seed=2).make(vocab)
    decode = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    best_decode = best_prefill = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        llm.generate([prompt], one, use_tqdm=False)
        first = time.process_time() - t
        t = time.process_time()
        llm.generate([prompt], decode, use_tqdm=False)
        # the decode steps alone: the request's time less its prefill (timed just before)
        best_decode = min(best_decode, time.process_time() - t - first)
        t = time.process_time()
        llm.generate([long], one, use_tqdm=False)
        best_prefill = min(best_prefill, time.process_time() - t)
    result = {
        "dtype": str(runner.dtype),
        "load_s": load_s,
        "decode_tok_per_s": (decode_tokens - 1) / best_decode,
        "prefill_tok_per_s": prefill_tokens / best_prefill,
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--output", default=None, help="write the JSON here")
    parser.add_argument(
        "--model", default=None, help="a model path or GGUF file (default: the default model)"
    )
    parser.add_argument(
        "--llama-bench", default=None, help="llama.cpp's llama-bench: measure it on --model too"
    )
    args = parser.parse_args()
    results = {}
    for name in args.configs:
        results[name] = measure(
            CONFIGS[name], args.decode_tokens, args.prefill_tokens, args.repeats, args.model
        )
        r = results[name]
        print(
            f"{name:>10} ({r['dtype']}): decode {r['decode_tok_per_s']:.1f} tok/s, prefill "
            f"{r['prefill_tok_per_s']:.0f} tok/s, load {r['load_s']:.1f} s",
            flush=True,
        )
    if "fp32" in results:
        base = results["fp32"]
        for name, r in results.items():
            decode = r["decode_tok_per_s"] / base["decode_tok_per_s"]
            prefill = r["prefill_tok_per_s"] / base["prefill_tok_per_s"]
            print(f"{name:>10} / fp32: decode {decode:.2f}x, prefill {prefill:.2f}x")
    if args.llama_bench:
        if args.model is None:
            parser.error("--llama-bench needs --model (a GGUF file)")
        llama = llama_cpp_rates(
            args.llama_bench, args.model, args.prefill_tokens, args.decode_tokens
        )
        results["llama.cpp"] = llama
        for name, r in results.items():
            print(
                f"{name:>10} / llama.cpp: decode "
                f"{r['decode_tok_per_s'] / llama['decode_tok_per_s']:.2f}x "
                f"({llama['decode_tok_per_s']:.1f} tok/s), prefill "
                f"{r['prefill_tok_per_s'] / llama['prefill_tok_per_s']:.2f}x "
                f"({llama['prefill_tok_per_s']:.1f} tok/s)"
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
