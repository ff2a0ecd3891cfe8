"""`minivllm bench serve --compare llama.cpp`: the same streaming client against `minivllm
serve` and against llama.cpp's own server, on the same GGUF, one after the other, or with
`--rounds N` all started at once and taking turns at each level N times (medians, and each
round's ratio: a noisy host's speed moves between minutes).

Each server is started here, waited for, loaded at c=1 (4 requests, 64-token prompts) and at
c=16 (16 requests, prompts of 32-256 tokens), 128 output tokens each, `ignore_eos` (other
workloads: `PLANS`), and stopped; then the two are printed side by side with their ratios, of
output tokens a second and of the time between tokens (ITL p50: the decode alone). The
llama.cpp server is the one `benchmarks/build_llama_cpp.sh` builds (`--llama-server PATH` or
`$LLAMA_SERVER` to use another), with as many slots as the widest level and one thread per core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from minivllm.bench.common import machine
from minivllm.bench.serve import SERVE_VOCAB_SIZE, acceptance, read_spec_counters, run_level
from minivllm.bench.text_workloads import (
    EDIT_OUTPUT_TOKENS,
    LONG_CONTEXTS,
    LONG_OUTPUT_TOKENS,
    RANDOM_ID_WORKLOADS,
    text_prompts,
)
from minivllm.bench.workloads import Workload
from minivllm.config import SPECULATION_OFF, SpeculativeConfig, cli_flag

# (name, concurrency, requests, prompt lengths): the levels of docs/benchmarks.md's table
LEVELS = [("c=1", 1, 4, (64, 64)), ("c=16", 16, 16, (32, 256))]
OUTPUT_TOKENS = 128


class LevelPlan(NamedTuple):
    """What a workload's comparison runs: its levels, the tokens each request asks for, and
    the tokens of each llama-server slot."""

    levels: list[tuple[str, int, int, tuple[int, int]]]
    output_tokens: int
    slot_tokens: int


# The edit workload (a 1k-token file, 400 tokens of it again): one stream, llama-server's slots
# long enough to hold it; the long one: one stream decoding after 2k and 8k-token prompts (two
# requests each, their decode compared by ITL: after 8k tokens an answer's rate is mostly its
# prefill); every other workload the table's levels
PLANS = {
    "edit": LevelPlan(LEVELS[:1], EDIT_OUTPUT_TOKENS, 2048),
    "long": LevelPlan(
        [(f"c=1 {n // 1000}k", 1, 2, (n, n)) for n in LONG_CONTEXTS],
        LONG_OUTPUT_TOKENS,
        max(LONG_CONTEXTS) + LONG_OUTPUT_TOKENS + 256,
    ),
}
DEFAULT_PLAN = LevelPlan(LEVELS, OUTPUT_TOKENS, 512)


def level_plan(workload: str) -> LevelPlan:
    """The levels, output length and llama-server slot size `workload` runs with."""
    return PLANS.get(workload, DEFAULT_PLAN)


LLAMA_SERVER_CACHE = Path("~/.cache/minivllm/llama.cpp").expanduser()


def find_llama_server(explicit: str | None) -> Path:
    """The llama-server binary: `--llama-server`, `$LLAMA_SERVER`, or the newest build of
    benchmarks/build_llama_cpp.sh."""
    given = explicit or os.environ.get("LLAMA_SERVER")
    if given:
        path = Path(given).expanduser()
    else:
        builds = sorted(LLAMA_SERVER_CACHE.glob("build-*/bin/llama-server"))
        if not builds:
            raise SystemExit(
                "no llama-server found: run `bash benchmarks/build_llama_cpp.sh` "
                "(about 15 minutes on 2 cores) or pass --llama-server PATH"
            )
        path = builds[-1]
    if not os.access(path, os.X_OK):
        raise SystemExit(f"llama-server {path} is not an executable file")
    return path


@contextmanager
def running(command: list[str], url: str, ready_path: str, timeout: float = 600):
    """Start a server process, wait until `url + ready_path` answers 200, yield the process,
    stop it after."""
    import httpx

    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-peer-{os.getpid()}.log", "ab")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited with {process.returncode} (log: {log.name})")
            try:
                if httpx.get(url + ready_path, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} was not ready after {timeout:.0f} s")
            time.sleep(0.1)  # a start-up figure is read to the poll's step
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def level_prompts(workload: str, tokenizer: Any, seed: int) -> list[list[int]]:
    """Each level's prompts: random ids of the level's lengths, or `workload`'s chat requests
    through the model's chat template (text_workloads.py)."""
    prompts = []
    for i, (_, concurrency, count, lengths) in enumerate(level_plan(workload).levels):
        if workload in RANDOM_ID_WORKLOADS:
            # the long levels share a concurrency: a seed each, or the 8k prompts would begin
            # with the 2k ones, a prefix both servers would have cached
            level_seed = seed + concurrency + (1000 * i if workload == "long" else 0)
            ids, _ = Workload(count, lengths, (1, 1), level_seed).make(SERVE_VOCAB_SIZE)
        else:
            ids = text_prompts(tokenizer, workload, count, seed + concurrency)
        prompts.append(ids)
    return prompts


def load_levels(
    url: str, prompts: list[list[list[int]]], workload: str = "random"
) -> list[dict[str, Any]]:
    """Run every level of `workload`'s levels, with its prompts, against the server at `url`; a
    level on a server that speculates also carries the drafts' acceptance."""
    return [load_level(url, prompts, workload, i) for i in range(len(prompts))]


def load_level(
    url: str, prompts: list[list[list[int]]], workload: str, index: int
) -> dict[str, Any]:
    """Level `index` of `workload`'s plan against the server at `url`, after a warm-up request."""
    import httpx

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    plan = level_plan(workload)
    name, concurrency, _, _ = plan.levels[index]
    asyncio.run(run_level(url, model, prompts[index][:1], 4, 1))  # warm-up: one short request
    before = read_spec_counters(url)
    level = asyncio.run(run_level(url, model, prompts[index], plan.output_tokens, concurrency))
    spec = acceptance(before, read_spec_counters(url))
    if spec is not None:
        level["spec_decode"] = spec
    return dict(level, name=name, tok_per_s=level["output_tok_per_s"])


def taking_turns(
    urls: dict[str, str], prompts: list[list[list[list[int]]]], workload: str
) -> dict[str, list[dict[str, Any]]]:
    """Every server (all started) runs each level once a round, one after the other, the first
    of each round the next server; `prompts[r]` are round r's (each round its own, as a run
    without rounds sees prompts no server has cached). Each level's figures are the medians
    over the rounds, and its `rounds` keep each round's tok/s and ITL p50 for paired ratios.
    On a host whose speed moves between minutes, runs one after the other compare the minutes
    as much as the servers."""
    names = list(urls)
    levels = len(prompts[0])
    per_round: dict[str, list[list[dict[str, Any]]]] = {
        n: [[] for _ in range(levels)] for n in names
    }
    for r, round_prompts in enumerate(prompts):
        for i in range(levels):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                level = load_level(urls[name], round_prompts, workload, i)
                per_round[name][i].append(level)
                print(
                    f"round {r + 1} {name} {level['name']}: {level['tok_per_s']:.1f} tok/s",
                    flush=True,
                )
    return {n: [_median_level(runs) for runs in per_round[n]] for n in names}


def _median_level(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's rounds as one: each figure's median, each round's tok/s and ITL p50 kept."""
    merged = dict(levels[0])
    for key, value in levels[0].items():
        if isinstance(value, float):
            merged[key] = statistics.median(level[key] for level in levels)
    merged["rounds"] = [
        {"tok_per_s": level["tok_per_s"], "itl_p50_s": level["itl_p50_s"]} for level in levels
    ]
    return merged


def peer_commands(
    gguf: Path,
    llama_server: Path,
    options: dict[str, Any],
    ports: tuple[int, int],
    llama_spec_type: str | None = None,
    workload: str = "random",
) -> dict[str, list[str]]:
    """How each server is started: ours with the engine options given, llama.cpp's with a
    slot per stream of the widest level (512 tokens each; the edit workload's, 2048), one
    thread per core and its `--spec-type` if given (`ngram-simple`: its prompt lookup, off by
    default)."""
    ours = [sys.executable, "-m", "minivllm.cli", "serve", str(gguf), "--port", str(ports[0])]
    for key, value in options.items():
        if key == "model" or value is None:
            continue
        if value is True or value is False:
            ours.append(cli_flag(key, negated=not value))
        else:
            ours += [cli_flag(key), str(value)]
    plan = level_plan(workload)
    slots = max(concurrency for _, concurrency, _, _ in plan.levels)
    threads = str(os.cpu_count() or 1)
    theirs = [
        str(llama_server),
        "-m",
        str(gguf),
        "--port",
        str(ports[1]),
        "-np",
        str(slots),
        "-c",
        str(plan.slot_tokens * slots),
        "-t",
        threads,
        "-tb",
        threads,
        "--no-webui",
    ]
    if llama_spec_type:
        theirs += ["--spec-type", llama_spec_type]
    return {"minivllm": ours, "llama.cpp": theirs}


def _describe(run: dict[str, Any]) -> str:
    spec = run.get("spec_decode")
    return (
        f"{run['tok_per_s']:6.1f} tok/s (TTFT p50 {run['ttft_p50_s'] * 1e3:5.0f} ms, ITL p50 "
        f"{run['itl_p50_s'] * 1e3:4.1f} p99 {run['itl_p99_s'] * 1e3:5.1f} ms"
        + (f", acceptance {spec['acceptance_rate']:.0%}" if spec else "")
        + ")"
    )


def cmd_compare_llama_cpp(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from minivllm.models.gguf import build_tokenizer
    from minivllm.models.paths import default_model_path

    gguf = Path(options.get("model") or default_model_path()).expanduser()
    if gguf.suffix.lower() != ".gguf":
        raise SystemExit(f"--compare llama.cpp needs a .gguf model, got {gguf}")
    tokenizer = build_tokenizer(gguf) if args.workload not in RANDOM_ID_WORKLOADS else None
    prompts = level_prompts(args.workload, tokenizer, args.seed)
    # each round its own prompts (a seed apart): a prompt again would be a cached prefix
    each_round = [
        level_prompts(args.workload, tokenizer, args.seed + 101 * r) for r in range(1, args.rounds)
    ]
    llama_server = find_llama_server(args.llama_server)
    # Unless told not to speculate (whose default on the CPU is to, where it pays), the same
    # engine also runs with the off switch, so one run gives both ratios.
    configs = {"minivllm": options}
    given = options.get("speculative_config")
    if given is None or SpeculativeConfig.parse(given) is not None:
        configs["minivllm, no speculation"] = dict(options, speculative_config=SPECULATION_OFF)
    # here, not at the top: the module is imported by every `minivllm` command's parser, and
    # parallel_state imports torch (0.8 s before `minivllm serve` started its engine)
    from minivllm.distributed.parallel_state import free_loopback_port

    commands: dict[str, list[str]] = {}
    urls: dict[str, str] = {}
    for name in [*configs, "llama.cpp"]:
        port = free_loopback_port()
        ours = configs.get(name, options)
        pair = peer_commands(
            gguf, llama_server, ours, (port, port), args.llama_spec_type, args.workload
        )
        commands[name] = pair["llama.cpp" if name == "llama.cpp" else "minivllm"]
        urls[name] = f"http://127.0.0.1:{port}"
        print(f"{name}: {' '.join(commands[name])}", flush=True)
    ready = {name: "/health" if name == "llama.cpp" else "/v1/models" for name in urls}
    runs = {}
    if args.rounds <= 1:  # one server at a time, each stopped before the next starts
        for name, url in urls.items():
            with running(commands[name], url, ready[name]):
                runs[name] = load_levels(url, prompts, args.workload)
    else:
        with ExitStack() as servers:
            for name, url in urls.items():
                servers.enter_context(running(commands[name], url, ready[name]))
            runs = taking_turns(urls, [prompts, *each_round], args.workload)
    results = [dict(r, name=f"{peer} {r['name']}") for peer in runs for r in runs[peer]]
    return {
        "benchmark": "serve vs llama.cpp",
        "gguf": str(gguf),
        "workload": args.workload,
        "machine": machine(),
        "commands": commands,
        "rounds": max(1, args.rounds),
        "ratios": print_ratios(runs),
        "results": results,
    }


def print_ratios(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each level of each of our configurations (every run but llama.cpp's, in their order)
    against llama.cpp's, printed: the ratio of output tokens a second, of the time between
    tokens (theirs over ours: the decode alone) and, with drafts, against our own run without."""
    ours = [name for name in runs if name != "llama.cpp"]
    rows = []
    base = runs.get("minivllm, no speculation")
    for i, theirs in enumerate(runs["llama.cpp"]):
        print(f"{theirs['name']:>5}: llama.cpp {_describe(theirs)}", flush=True)
        for name in ours:
            level = runs[name][i]
            row = {"level": level["name"], "server": name}
            row["ratio"] = level["tok_per_s"] / theirs["tok_per_s"]
            row["itl_ratio"] = theirs["itl_p50_s"] / level["itl_p50_s"]
            text = (
                f"{'':>5}  {name} {_describe(level)} | {row['ratio']:.2f}x llama.cpp "
                f"(ITL p50 {row['itl_ratio']:.2f}x)"
            )
            if "rounds" in level:  # each round's ratio, the servers side by side in time
                row["round_ratios"] = [
                    ours_r["tok_per_s"] / theirs_r["tok_per_s"]
                    for ours_r, theirs_r in zip(level["rounds"], theirs["rounds"], strict=True)
                ]
                text += f", rounds {' '.join(f'{x:.2f}x' for x in row['round_ratios'])}"
            if base is not None and name == "minivllm":
                row["ratio_vs_no_speculation"] = level["tok_per_s"] / base[i]["tok_per_s"]
                text += f", {row['ratio_vs_no_speculation']:.2f}x no speculation"
            print(text, flush=True)
            rows.append(row)
    return rows
