"""What `minivllm serve --lab` costs at concurrency 16, measured two ways on one engine (the
default model unless --model):

1. Paired steps: 16 requests decode together and the steps alternate between a plain
   `engine.step()` and `LiveRecorder.step` (the same step, plus noting the plan and the photo
   after the commit), so both modes see the same batches and the same machine noise; prints
   the mean step time of each and their ratio, and the photo's own cost in microseconds.
2. End to end: server throughput (output tokens/s) without --lab, with it, and with it while a
   page polls /lab/api/frames, through the real app and uvicorn on a loopback port; the modes
   alternate round by round (fresh random prompts per run: no prefix-cache hits).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/live_lab_overhead.py [--rounds 4]

(OMP_NUM_THREADS=1 on a shared 2-core machine: spinning OpenMP threads slow every step 20x.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from minivllm.bench.workloads import random_prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.lab.live import LiveRecorder
from minivllm.sampling_params import SamplingParams
from minivllm.server import ServerThread, create_app

MODES = ("off", "lab", "lab+viewer")


async def _load(
    url: str, prompts: list[list[int]], max_tokens: int, concurrency: int, viewer: bool
) -> int:
    """Send every prompt, `concurrency` at a time; returns the output tokens received."""
    semaphore = asyncio.Semaphore(concurrency)
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: list[int]) -> int:
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
            }
            async with semaphore:
                r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        async def watch() -> None:  # what the live page does: poll the new frames
            after = -1
            while not done.is_set():
                r = await client.get(f"{url}/lab/api/frames", params={"after": after})
                frames = r.json()["frames"]
                after = frames[-1]["index"] if frames else after
                await asyncio.sleep(0.3)

        watcher = asyncio.create_task(watch()) if viewer else None
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        done.set()
        if watcher is not None:
            await watcher
    return tokens


def run(engine: LLMEngine, mode: str, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Output tokens per second of one run in `mode`."""
    app = create_app(engine, "m", lab=mode != "off")
    with ServerThread(app) as server:
        start = time.perf_counter()
        tokens = asyncio.run(
            _load(
                server.base_url,
                prompts,
                args.max_tokens,
                args.concurrency,
                viewer=mode == "lab+viewer",
            )
        )
        seconds = time.perf_counter() - start
    return tokens / seconds


def paired_steps(engine: LLMEngine, prompts: list[list[int]], steps: int) -> None:
    """Part 1 (see the module docstring)."""
    recorder = LiveRecorder.for_engine(engine)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    names = {s.seq_id: f"cmpl-{s.seq_id:032x}/0" for s in seqs}
    while any(s.num_cached_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()  # the prefills
    times: dict[str, list[float]] = {"off": [], "lab": []}
    for i in range(steps):
        # off, lab, lab, off: each step is a little longer than the last (one more token of
        # context), and this order cancels that drift within every four steps
        mode = "off" if i % 4 in (0, 3) else "lab"
        start = time.perf_counter()
        if mode == "off":
            engine.step()
        else:
            recorder.step(engine, names)
        times[mode].append(time.perf_counter() - start)
        if (i + 1) % 40 == 0:
            print(f"  step {i + 1}/{steps}: {times[mode][-1] * 1e3:.1f} ms", flush=True)
    photo = time.perf_counter()
    for _ in range(200):
        recorder.snapshot(engine, names)
    photo = (time.perf_counter() - photo) / 200
    for s in seqs:
        engine.abort_request(s.seq_id)
    off, lab = (statistics.mean(times[m]) for m in ("off", "lab"))
    lab_t, off_t = times["lab"], times["off"]
    quads = [
        (lab_t[2 * q] + lab_t[2 * q + 1]) / (off_t[2 * q] + off_t[2 * q + 1])
        for q in range(len(off_t) // 2)
    ]
    print(
        f"paired steps, {len(prompts)} sequences decoding, {steps} steps: mean step "
        f"{off * 1e3:.2f} ms off, {lab * 1e3:.2f} ms with the recorder ({lab / off:.3f}x; "
        f"median of the {len(quads)} four-step ratios {statistics.median(quads):.3f}x); "
        f"the photo alone {photo * 1e6:.0f} us ({photo / off:.2%} of a step)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=160, help="paired steps (part 1)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    options = {"model": args.model, "max_model_len": 1024}
    if args.device:
        options["device"] = args.device
    engine = LLMEngine.from_options(**options)
    rng = random.Random(0)
    vocab = engine.model_runner.vocab_size

    def prompts() -> list[list[int]]:
        return [random_prompt(rng, args.prompt_len, vocab) for _ in range(args.requests)]

    paired_steps(engine, prompts()[: args.concurrency], args.steps)
    run(engine, "off", prompts()[:16], args)  # warm-up
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            results[mode].append(run(engine, mode, prompts(), args))
            print(f"round {r + 1} {mode:>10}: {results[mode][-1]:8.1f} output tok/s", flush=True)
    base = statistics.median(results["off"])
    print(
        f"\nc={args.concurrency}, {args.requests} requests x {args.max_tokens} tokens, "
        f"{args.rounds} rounds; median output tok/s and ratio to off:"
    )
    for mode in MODES:
        median = statistics.median(results[mode])
        print(f"  {mode:>10}: {median:8.1f}  ({median / base:.3f}x)")


if __name__ == "__main__":
    main()
