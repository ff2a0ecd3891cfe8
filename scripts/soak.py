"""Soak the OpenAI-compatible server: many streaming requests, a third of the clients
disconnecting mid-stream, optional injected runner faults; then check that nothing was lost
and nothing leaked.

    .venv/bin/python scripts/soak.py --model DIR [--requests 2000] [--duration 600]
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 [--api-key KEY]

With --model it starts its own server in-process on a KV pool small enough to force
preemption (--num-kv-blocks 64 --max-num-seqs 16 by default) and can inject runner faults
(--fault-every N: every Nth ModelRunner.run raises). With --url it drives a server that is
already running (loopback only). The CI version is tests/test_reliability_soak.py.

Checks: every request that was not abandoned got its whole greedy completion exactly once
(streamed text == the non-streamed reference of the same prompt, usage == max_tokens,
finish_reason "length", one [DONE]), or an error event naming an injected fault; /health is
OK; no request runs or waits and kv usage is 0; in-process also that the server's request
bookkeeping is empty and the log holds no error but the injected ones. Exit 0 when clean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
INJECTED = "injected fault"  # the message of tests/support/faults.py's InjectedFault
WORDS = (
    "the quick brown fox jumps over lazy dog paged attention stores keys and values in "
    "blocks a scheduler mixes prefill chunks with decode steps one batch hello world how "
    "are you today once upon time there was tiny language model that loved numbers"
).split()


@dataclass(frozen=True)
class Spec:
    """One request: its prompt, its length, and after how many chunks its client leaves."""

    index: int
    prompt: str
    max_tokens: int
    disconnect_after: int | None  # None: read to the end


@dataclass
class Result:
    spec: Spec
    status: int = 0
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done_events: int = 0
    error: str | None = None  # an error event's message, or a transport/HTTP error
    abandoned: bool = False  # the client disconnected on purpose
    retries_503: int = 0


@dataclass
class Report:
    results: list[Result]
    problems: list[str]
    metrics: dict[str, float]
    seconds: float
    num_references: int
    log_errors: list[str] = field(default_factory=list)

    def count(self, what: str) -> int:
        return sum(1 for r in self.results if _outcome(r) == what)

    def summary(self) -> str:
        outcomes = {o: self.count(o) for o in ("completed", "abandoned", "injected_error")}
        retries = sum(r.retries_503 for r in self.results)
        tokens = sum(r.completion_tokens or 0 for r in self.results)
        m = self.metrics
        return (
            f"{len(self.results)} requests in {self.seconds:.1f}s: {outcomes}, "
            f"{retries} retries after 503, {tokens} tokens to completed clients, "
            f"{int(m.get('minivllm:num_preemptions_total', 0))} preemptions, "
            f"kv usage {m.get('minivllm:kv_cache_usage_perc')}, "
            f"{len(self.problems)} problems"
        )


def _outcome(r: Result) -> str:
    if r.abandoned:
        return "abandoned"
    if r.error is not None and INJECTED in r.error:
        return "injected_error"
    return "completed" if r.error is None else "failed"


# ---- the load --------------------------------------------------------------------------------


def make_specs(
    num_requests: int, seed: int = 0, num_prompts: int = 24, disconnect_fraction: float = 1 / 3
) -> list[Spec]:
    """Mixed lengths (4-120 words, 8-96 tokens) over a fixed set of distinct prompts, so
    each has one reference and prompts repeat (the prefix cache is exercised too)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(4, 121))]
        prompts.append((f"Request {i}: " + " ".join(words), rng.choice([8, 16, 32, 64, 96])))
    specs = []
    for index in range(num_requests):
        prompt, max_tokens = prompts[rng.randrange(num_prompts)]
        leave = rng.random() < disconnect_fraction
        specs.append(
            Spec(
                index,
                prompt,
                max_tokens,
                rng.randrange(1, max(2, max_tokens // 2)) if leave else None,
            )
        )
    return specs


def _body(model: str, spec: Spec, stream: bool) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def references(
    client: httpx.AsyncClient, model: str, specs: list[Spec]
) -> dict[tuple[str, int], str]:
    """The non-streamed greedy text of each distinct (prompt, max_tokens), one at a time."""
    refs: dict[tuple[str, int], str] = {}
    for spec in specs:
        key = (spec.prompt, spec.max_tokens)
        if key in refs:
            continue
        r = await client.post("/v1/completions", json=_body(model, spec, stream=False))
        r.raise_for_status()
        refs[key] = r.json()["choices"][0]["text"]
    return refs


async def stream_one(
    client: httpx.AsyncClient, model: str, spec: Spec, max_503_retries: int = 50
) -> Result:
    result = Result(spec)
    for _ in range(max_503_retries + 1):
        try:
            async with client.stream(
                "POST", "/v1/completions", json=_body(model, spec, stream=True)
            ) as r:
                result.status = r.status_code
                if r.status_code == 503:
                    result.retries_503 += 1
                    await r.aread()
                    await asyncio.sleep(0.05)
                    continue
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    return result
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        result.done_events += 1
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        result.error = event["error"]["message"]
                        continue
                    if event.get("usage"):
                        result.completion_tokens = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        result.chunks += 1
                        result.text += choice["text"]
                        result.finish_reason = choice["finish_reason"] or result.finish_reason
                    if spec.disconnect_after is not None and result.chunks >= spec.disconnect_after:
                        result.abandoned = result.finish_reason is None
                        if result.abandoned:
                            return result  # leaving the block closes the connection mid-stream
                return result
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
    result.error = f"still 503 after {max_503_retries} retries"
    return result


async def run_load(
    client: httpx.AsyncClient, model: str, specs: list[Spec], concurrency: int, deadline: float
) -> list[Result]:
    """`concurrency` clients take specs in order until none is left or the deadline passed."""
    pending = list(reversed(specs))
    results: list[Result] = []

    async def worker() -> None:
        while pending and time.monotonic() < deadline:
            results.append(await stream_one(client, model, pending.pop()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.spec.index)


def check(results: list[Result], refs: dict[tuple[str, int], str]) -> list[str]:
    problems = []
    for r in results:
        spec = r.spec
        what = _outcome(r)
        if what == "failed":
            problems.append(f"request {spec.index}: {r.error}")
        elif what == "injected_error" and r.done_events != 1:
            problems.append(f"request {spec.index}: error event without one [DONE]")
        elif what == "completed":
            want = refs[(spec.prompt, spec.max_tokens)]
            if r.text != want:
                problems.append(f"request {spec.index}: streamed {r.text!r} != reference {want!r}")
            if (r.completion_tokens, r.finish_reason, r.done_events) != (
                spec.max_tokens,
                "length",
                1,
            ):
                problems.append(
                    f"request {spec.index}: usage {r.completion_tokens}/{spec.max_tokens}, "
                    f"finish {r.finish_reason}, {r.done_events} [DONE]"
                )
    return problems


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def wait_idle(client: httpx.AsyncClient, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(client)
        busy = m["minivllm:num_requests_running"] or m["minivllm:num_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


async def soak(
    base_url: str,
    specs: list[Spec],
    concurrency: int = 24,
    duration: float = 600,
    api_key: str | None = None,
    on_load_start: Callable[[], None] | None = None,
) -> Report:
    """Run `specs` against the server at `base_url` and check the outcome. `on_load_start`
    runs once the references are made, just before the load (it arms the faults)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=120, limits=limits
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        refs = await references(client, model, specs)
        if on_load_start is not None:
            on_load_start()
        start = time.monotonic()
        results = await run_load(client, model, specs, concurrency, start + duration)
        seconds = time.monotonic() - start
        problems = check(results, refs)
        m = await wait_idle(client)
        health = await client.get("/health")
    if health.status_code != 200:
        problems.append(f"/health answered {health.status_code}")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        if m[f"minivllm:{name}"] != 0:
            problems.append(f"{name} is {m[f'minivllm:{name}']} once idle, not 0")
    return Report(results, problems, m, seconds, len(refs))


# ---- an in-process server ------------------------------------------------------------------


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def unexpected(self) -> list[str]:
        """Error records that are not about an injected fault."""
        out = []
        for record in self.records:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f" ({record.exc_info[1]})"
            if INJECTED not in text:
                out.append(text)
        return out


@contextlib.contextmanager
def local_server(model_dir: str, **engine_options: Any) -> Iterator[tuple[str, Any, _ErrorLog]]:
    """A server on `model_dir` in this process, its runner behind tests/support/faults.py's
    FaultyRunner (disarmed); yields (base_url, its OpenAIServer, the error log)."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.server import ServerThread, create_app

    options = {
        "device": "cpu",
        "max_model_len": 512,
        "num_kv_blocks": 64,
        "max_num_seqs": 16,
        **engine_options,
    }
    engine = LLMEngine.from_options(model=model_dir, **options)
    sys.path.insert(0, str(REPO / "tests"))
    from support.faults import FaultyRunner

    engine = LLMEngine(engine.config, FaultyRunner(engine.model_runner), engine.tokenizer)
    errors = _ErrorLog()
    root = logging.getLogger()
    root.addHandler(errors)
    try:
        app = create_app(engine, "soak")
        with ServerThread(app) as thread:
            yield thread.base_url, app.state.server, errors
    finally:
        root.removeHandler(errors)


def soak_local(
    model_dir: str,
    specs: list[Spec],
    concurrency: int = 24,
    duration: float = 600,
    fail_on_calls: set[int] | frozenset[int] = frozenset(),
    **engine_options: Any,
) -> tuple[Report, Any]:
    """`soak` against a fresh in-process server; adds the log and bookkeeping checks.
    `fail_on_calls`: ModelRunner.run calls (counted from the start of the load) that raise.
    Returns the report and the server's LLMEngine. The engine runs in float32 unless told
    otherwise: streamed == reference holds where numerics do not depend on the batch's shape
    (bf16 kernels and the compiled one-sequence step round differently from step to step)."""
    engine_options.setdefault("dtype", "float32")
    with local_server(model_dir, **engine_options) as (url, server, errors):
        engine = server.engine.engine  # the AsyncLLMEngine's LLMEngine
        runner = engine.model_runner

        def arm() -> None:  # call numbers count from the start of the load
            runner.fail_on_calls = {runner.calls + c for c in fail_on_calls}

        report = asyncio.run(soak(url, specs, concurrency, duration, on_load_start=arm))
        # Idle now: the engine loop's own maps of live requests must be empty.
        leftovers = server.engine.num_tracked()
        report.log_errors = errors.unexpected()
    report.problems += [f"log: {e}" for e in report.log_errors]
    if leftovers != (0, 0):
        report.problems.append(f"server bookkeeping not empty: {leftovers} (requests, subs)")
    return report, engine


# ---- the command ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="start a server in-process on this model directory")
    where.add_argument("--url", help="drive a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--duration", type=float, default=600, help="stop sending after this (s)")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--disconnect-fraction", type=float, default=1 / 3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument(
        "--fault-every",
        type=int,
        default=0,
        help="with --model: every Nth ModelRunner.run raises an injected fault",
    )
    args = p.parse_args(argv)
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        p.error("--url must be a loopback address")
    specs = make_specs(args.requests, args.seed, disconnect_fraction=args.disconnect_fraction)
    if args.url:
        report = asyncio.run(soak(args.url, specs, args.concurrency, args.duration, args.api_key))
    else:
        every = args.fault_every
        faults = set(range(every, 10**6, every)) if every else set()
        report, _ = soak_local(
            args.model,
            specs,
            args.concurrency,
            args.duration,
            faults,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
        )
    print(report.summary())
    for problem in report.problems[:50]:
        print("PROBLEM:", problem)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
