"""Throughput of data-parallel replicas: 2 Ray Serve replicas of one CPU each, against 1
replica of one CPU and against one `minivllm serve` with two cores, at one concurrency.

Each setup gets the same streamed load (`minivllm bench serve`'s client: random token-id
prompts, `ignore_eos`, a fixed output length) after a short warm-up. Needs the `ray` extra.

    .venv/bin/python benchmarks/scale_replicas.py --concurrency 16 --num-requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from minivllm.bench.serve import SERVE_VOCAB_SIZE, run_level
from minivllm.bench.workloads import Workload

REPLICA_HEADER = "x-minivllm-replica"  # minivllm.scale.ray_serve's (importing it needs ray)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, replicas: int, timeout: float = 600) -> None:
    """Until the server answers, and (behind Ray Serve's proxy, which answers as soon as one
    replica is up) until `replicas` different replicas have answered."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=5)
            if models.status_code == 200:
                seen.add(models.headers.get(REPLICA_HEADER, ""))
                if len(seen) >= replicas:
                    return
                continue
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in {timeout}s")


def measure(
    name: str, command: list[str], args: argparse.Namespace, port: int, replicas: int = 1
) -> dict:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc, replicas)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        workload = Workload(args.num_requests, (args.input_min, args.input_max), (1, 1), args.seed)
        prompts, _ = workload.make(SERVE_VOCAB_SIZE)
        # Warm-up: every replica loads its kernels before the clock starts.
        asyncio.run(run_level(url, model, prompts[: args.concurrency], 4, args.concurrency))
        level = asyncio.run(run_level(url, model, prompts, args.output_len, args.concurrency))
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    level["setup"] = name
    print(
        f"{name}: {level['output_tok_per_s']:.1f} tok/s, TTFT p50 "
        f"{level['ttft_p50_s'] * 1e3:.0f} ms, ITL p50 {level['itl_p50_s'] * 1e3:.0f} ms",
        flush=True,
    )
    return level


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: minivllm's default model")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-min", type=int, default=32)
    parser.add_argument("--input-max", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the JSON here")
    args = parser.parse_args()

    serve = [sys.executable, "-m", "minivllm.cli", "serve", "--enforce-eager"]
    if args.model:
        serve += ["--model", args.model]
    results: list[dict[str, Any]] = []
    port = _free_port()
    results.append(measure("1 server, 2 cores", [*serve, "--port", str(port)], args, port))
    for replicas in (1, 2):
        port = _free_port()
        command = [
            *serve,
            "--port",
            str(port),
            "--ray",
            "--num-replicas",
            str(replicas),
            "--replica-cpus",
            "1",
        ]
        results.append(measure(f"{replicas} Ray replica(s) x 1 CPU", command, args, port, replicas))
    one, two = results[1]["output_tok_per_s"], results[2]["output_tok_per_s"]
    print(
        f"2 replicas / 1 replica: {two / one:.2f}x; 2 replicas / 1 server on 2 cores: "
        f"{two / results[0]['output_tok_per_s']:.2f}x"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
