"""The server with its engine on a thread of the HTTP process against the engine in a process
of its own, side by side, with the same streaming client as `minivllm bench serve --compare
llama.cpp` (its two levels, c=1 and c=16), and llama.cpp's server as the yardstick.

    .venv/bin/python benchmarks/serve_engine_modes.py [--model GGUF] [--no-llama-cpp]
        [--rounds 1]

Each round starts `minivllm serve --no-engine-process`, `minivllm serve` (the engine process,
the default) and, unless `--no-llama-cpp`, llama.cpp's server (built by
`benchmarks/build_llama_cpp.sh`), one after the other, and prints tok/s, TTFT and
inter-token p50 for each level.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minivllm.bench.peer import find_llama_server, load_levels, peer_commands, running
from minivllm.distributed.parallel_state import free_loopback_port
from minivllm.models.paths import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    gguf = Path(args.model or default_model_path())
    cli = [sys.executable, "-m", "minivllm.cli", "serve", str(gguf)]
    for _ in range(args.rounds):
        servers = {"thread": [*cli, "--no-engine-process"], "process": cli}
        if not args.no_llama_cpp:
            servers["llama.cpp"] = []
        for name, command in servers.items():
            port = free_loopback_port()
            if name == "llama.cpp":
                command = peer_commands(gguf, find_llama_server(None), {}, (0, port))[name]
                ready = "/health"
            else:
                command = [*command, "--port", str(port)]
                ready = "/v1/models"
            url = f"http://127.0.0.1:{port}"
            with running(command, url, ready):
                levels = load_levels(url, seed=0)
            for level in levels:
                print(
                    f"{name:>9} {level['name']:>5}: {level['tok_per_s']:6.1f} tok/s, "
                    f"TTFT p50 {level['ttft_p50_s'] * 1e3:5.0f} ms, "
                    f"ITL p50 {level['itl_p50_s'] * 1e3:5.1f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
