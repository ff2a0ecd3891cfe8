"""`minivllm bench serve`: streaming load against a running server at several concurrencies.

For each concurrency level it sends `num_requests` streaming completions (random token-id
prompts, `ignore_eos`, fixed output length), `concurrency` at a time, and reports time to
first token and inter-token latency (p50, p99) and output throughput. When the server
speculates, each level also reports the drafts' acceptance: the change of vLLM's spec-decode
counters on /metrics over the level (minivllm and vLLM export the same `vllm:` names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from minivllm.bench.text_workloads import bench_tokenizer, text_prompts
from minivllm.bench.workloads import Workload
from minivllm.engine.spec_decode import mean_acceptance_length

# Prompt ids are drawn below this: the served model's vocabulary is not asked for.
SERVE_VOCAB_SIZE = 20100


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1 <= q <= 99), interpolated; nan for no values."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


_SPEC_COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics_text: str) -> dict[str, float]:
    """vLLM's spec-decode counters in a /metrics text: the three totals by their short name,
    and `per_pos/j` for position j (summed over other labels, such as vLLM's `engine`)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name.removesuffix("_total")
            if name == _PER_POS:
                key = f"per_pos/{sample.labels.get('position', '0')}"
            elif name.startswith("vllm:") and name[len("vllm:") :] in _SPEC_COUNTERS:
                key = name.removeprefix("vllm:")
            else:
                continue
            counters[key] = counters.get(key, 0.0) + sample.value
    return counters


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """The drafts' acceptance between two `spec_counters` readings; None if none verified."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts = delta.get("spec_decode_num_drafts", 0.0)
    draft_tokens = delta.get("spec_decode_num_draft_tokens", 0.0)
    if not drafts or not draft_tokens:
        return None
    accepted = delta.get("spec_decode_num_accepted_tokens", 0.0)
    positions = sorted(int(k.split("/")[1]) for k in delta if k.startswith("per_pos/"))
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens,
        "mean_acceptance_length": mean_acceptance_length(drafts, accepted),
        "per_position_acceptance": [delta[f"per_pos/{j}"] / drafts for j in positions],
    }


def read_spec_counters(url: str) -> dict[str, float]:
    """`spec_counters` of the server's /metrics; {} where it has none (llama.cpp's server)."""
    import httpx

    try:
        response = httpx.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    return spec_counters(response.text) if response.status_code == 200 else {}


async def one_request(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"server answered {response.status_code}: {(await response.aread()).decode()[:200]}"
            )
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


async def run_level(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, Any]:
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
        "concurrency": concurrency,
        "requests": len(prompts),
        "seconds": seconds,
        "stream_chunks": chunks,
        "output_tok_per_s": len(prompts) * max_tokens / seconds,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "itl_mean_s": statistics.fmean(itl) if itl else float("nan"),
    }


def cmd_serve_bench(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    import httpx

    if args.workload == "long":
        raise SystemExit(
            "minivllm bench serve: --workload long is a --compare llama.cpp plan; against a "
            "server of your own, set the prompts' lengths with --input-min / --input-max"
        )
    url = args.url.rstrip("/")
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    except httpx.HTTPError as error:
        raise SystemExit(
            f"minivllm bench serve: no server answers at {url} ({error}); start one "
            "(`minivllm serve MODEL`) or pass --compare llama.cpp to have both started here"
        ) from None
    # A text workload is tokenized with the `--model` given here (default: the default
    # model), which must be the one the server runs.
    tokenizer = bench_tokenizer(options.get("model")) if args.workload != "random" else None
    levels = []
    for concurrency in (1, 8, 32):
        count = max(concurrency, args.num_requests if concurrency > 1 else 4)
        if tokenizer is None:
            workload = Workload(
                count, (args.input_min, args.input_max), (1, 1), args.seed + concurrency
            )
            prompts, _ = workload.make(SERVE_VOCAB_SIZE)
        else:
            prompts = text_prompts(tokenizer, args.workload, count, args.seed + concurrency)
        before = read_spec_counters(url)
        level = asyncio.run(run_level(url, model, prompts, args.output_len, concurrency))
        spec = acceptance(before, read_spec_counters(url))
        if spec is not None:
            level["spec_decode"] = spec
        levels.append(level)
        print(
            f"concurrency {concurrency:>2}: {level['requests']} requests, "
            f"{level['output_tok_per_s']:.1f} tok/s, "
            f"TTFT p50 {level['ttft_p50_s'] * 1e3:.0f} ms "
            f"p99 {level['ttft_p99_s'] * 1e3:.0f} ms, "
            f"ITL p50 {level['itl_p50_s'] * 1e3:.0f} ms p99 {level['itl_p99_s'] * 1e3:.0f} ms"
            + (
                f", acceptance {spec['acceptance_rate']:.1%}, mean acceptance length "
                f"{spec['mean_acceptance_length']:.2f}"
                if spec is not None
                else ""
            ),
            flush=True,
        )
    return {
        "benchmark": "serve",
        "url": url,
        "model": model,
        "workload": args.workload,
        "output_len": args.output_len,
        "results": [
            dict(level, name=f"c={level['concurrency']}", tok_per_s=level["output_tok_per_s"])
            for level in levels
        ],
    }
