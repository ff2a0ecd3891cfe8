"""Resident memory of our server and llama-server on one GGUF, each once ready and after one
completion: VmRSS of every process of the server (ours: the HTTP process and the engine's).

    .venv/bin/python benchmarks/resident.py MODEL.gguf [MODEL.gguf ...] [--llama-server PATH]

Both servers start as `minivllm bench serve --compare llama.cpp` starts them (llama-server:
16 slots of 512 tokens), one after the other. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
from real_models import process_tree, vm_rss_mib  # beside this script

from minivllm.bench.peer import find_llama_server, peer_commands, running
from minivllm.distributed.parallel_state import free_loopback_port


def measure(command: list[str], url: str) -> list[float]:
    """The server's processes' VmRSS in MiB after one 32-token completion."""
    with running(command, url, "/v1/models") as process:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 32}
        httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()
        return [vm_rss_mib(pid) for pid in process_tree(process.pid)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--llama-server", default=None, metavar="PATH")
    args = parser.parse_args()
    llama_server = find_llama_server(args.llama_server)
    for gguf in args.models:
        ports = (free_loopback_port(), free_loopback_port())
        commands = peer_commands(gguf, llama_server, {}, ports)
        ours = measure(commands["minivllm"], f"http://127.0.0.1:{ports[0]}")
        theirs = measure(commands["llama.cpp"], f"http://127.0.0.1:{ports[1]}")
        parts = " + ".join(f"{m:.0f}" for m in ours)
        print(
            f"{gguf.name}: minivllm {parts} = {sum(ours):.0f} MiB, llama-server "
            f"{sum(theirs):.0f} MiB: {sum(ours) / sum(theirs):.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
