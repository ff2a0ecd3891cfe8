"""`minivllm bench serve`: streaming load against a running server at several concurrencies.

For each concurrency level it sends `num_requests` streaming completions (random token-id
prompts, `ignore_eos`, fixed output length), `concurrency` at a time, and reports time to
first token and inter-token latency (p50, p99) and output throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from minivllm.bench.workloads import Workload

# Prompt ids are drawn below this: the served model's vocabulary is not asked for.
SERVE_VOCAB_SIZE = 20100


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1 <= q <= 99), interpolated; nan for no values."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def one_request(client: Any, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"server answered {response.status_code}: "
                               f"{(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("the stream carried no tokens")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - start, gaps, len(arrivals)


async def run_level(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                    concurrency: int) -> dict[str, Any]:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    # A fresh connection per request: llama.cpp's server may close one after a stream, and
    # a pooled connection closed under the client fails the next request.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def bounded(prompt: list[int]) -> tuple[float, list[float], int]:
            async with semaphore:
                return await one_request(client, url, model, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        seconds = time.perf_counter() - start
    ttft = [r[0] for r in results]
    itl = [g for r in results for g in r[1]]
    chunks = sum(r[2] for r in results)
    return {
        "concurrency": concurrency, "requests": len(prompts), "seconds": seconds,
        "stream_chunks": chunks, "output_tok_per_s": len(prompts) * max_tokens / seconds,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "itl_mean_s": statistics.fmean(itl) if itl else float("nan"),
    }


def cmd_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    url = args.url.rstrip("/")
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    levels = []
    for concurrency in (1, 8, 32):
        count = max(concurrency, args.num_requests if concurrency > 1 else 4)
        workload = Workload(count, (args.input_min, args.input_max), (1, 1),
                            args.seed + concurrency)
        prompts, _ = workload.make(SERVE_VOCAB_SIZE)
        level = asyncio.run(run_level(url, model, prompts, args.output_len, concurrency))
        levels.append(level)
        print(f"concurrency {concurrency:>2}: {level['requests']} requests, "
              f"{level['output_tok_per_s']:.1f} tok/s, "
              f"TTFT p50 {level['ttft_p50_s'] * 1e3:.0f} ms "
              f"p99 {level['ttft_p99_s'] * 1e3:.0f} ms, "
              f"ITL p50 {level['itl_p50_s'] * 1e3:.0f} ms p99 {level['itl_p99_s'] * 1e3:.0f} ms",
              flush=True)
    return {"benchmark": "serve", "url": url, "model": model, "output_len": args.output_len,
            "results": [dict(level, name=f"c={level['concurrency']}",
                             tok_per_s=level["output_tok_per_s"]) for level in levels]}
