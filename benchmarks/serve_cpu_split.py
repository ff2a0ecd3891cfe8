"""Where the CPU goes while `minivllm serve` streams one request at a time: CPU milliseconds
per streamed token of the HTTP process, of the engine process and of the client (this
script), with the tok/s and inter-token p50 of the same run. On a machine with few cores the
HTTP process's and the client's work runs on the cores the engine's threads use.

    .venv/bin/python benchmarks/serve_cpu_split.py [--requests 4] [--tokens 128] [serve options]

Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

from minivllm.bench.peer import running
from minivllm.bench.serve import one_request
from minivllm.distributed.parallel_state import free_loopback_port


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args, serve_options = parser.parse_known_args()
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "minivllm.cli", "serve", "--port", str(port), *serve_options]
    with running(command, url, "/v1/models") as server:
        children = subprocess.run(
            ["pgrep", "-P", str(server.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        engine = int(children[0]) if children else None  # none with --no-engine-process
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)

        async def stream(count: int) -> list[tuple[float, list[float], int]]:
            async with httpx.AsyncClient(timeout=600) as client:
                return [
                    await one_request(
                        client,
                        url,
                        model,
                        [rng.randrange(100, 20000) for _ in range(64)],
                        args.tokens,
                    )
                    for _ in range(count)
                ]

        asyncio.run(stream(1))  # warm-up
        pids = [server.pid, engine]
        before = [cpu_seconds(p) if p else 0.0 for p in pids] + [time.process_time()]
        start = time.perf_counter()
        results = asyncio.run(stream(args.requests))
        wall = time.perf_counter() - start
        after = [cpu_seconds(p) if p else 0.0 for p in pids] + [time.process_time()]
    tokens = sum(r[2] for r in results)
    gaps = [g for r in results for g in r[1]]
    http, engine_ms, client = ((b - a) / tokens * 1e3 for a, b in zip(before, after))
    print(
        f"{tokens / wall:.1f} tok/s, inter-token p50 {statistics.median(gaps) * 1e3:.2f} ms; "
        f"CPU ms per token: HTTP process {http:.2f}, engine process {engine_ms:.2f}, "
        f"client {client:.2f}"
    )


if __name__ == "__main__":
    main()
