"""The time a multi-model server takes to switch between two models: `minivllm serve --model
A --model B --max-loaded-models 1`, requests alternating A, B, A, ... so that each one unloads
the other model and loads its own (warm caches: each model is loaded once before timing).

    .venv/bin/python benchmarks/model_switch.py [--model A.gguf --model B.gguf] [--switches 6]

Prints, per model, the median of: the request's wall time (unload of the other + load + a
1-token completion), the load alone (the server's `minivllm:model_last_load_seconds`), and a
1-token request on the loaded model. Without --model: the default model and a copy of it
under a second name.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from minivllm.models.paths import default_model_path
from minivllm.server import ServerThread
from minivllm.server.model_registry import ModelRegistry, RegistryLimits
from minivllm.server.model_specs import ModelSpec, model_name
from minivllm.server.multi_app import create_multi_app


def _complete(base: str, name: str) -> float:
    start = time.perf_counter()
    body = {"model": name, "prompt": "Hello", "max_tokens": 1}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None, help="a GGUF (twice)")
    parser.add_argument("--switches", type=int, default=6, help="timed switches per model")
    args = parser.parse_args()
    paths = args.model or [str(default_model_path())] * 2
    names = [model_name(p) for p in paths]
    if names[0] == names[1]:
        names[1] += "-copy"
    specs = [ModelSpec(n, {"model": p}) for n, p in zip(names, paths)]
    registry = ModelRegistry(specs, RegistryLimits(max_loaded_models=1))
    switch: dict[str, list[float]] = {n: [] for n in names}
    load: dict[str, list[float]] = {n: [] for n in names}
    loaded: dict[str, list[float]] = {n: [] for n in names}
    with ServerThread(create_multi_app(registry)) as server:
        for name in names:  # warm: the GGUF's converted tokenizer, compiled graphs, kernels
            _complete(server.base_url, name)
        for _ in range(args.switches):
            for name in names:
                switch[name].append(_complete(server.base_url, name))
                load[name].append(registry.entries[name].last_load_s or 0.0)
                loaded[name].append(_complete(server.base_url, name))
                print(f"  {name}: switch {switch[name][-1]:.2f} s, load {load[name][-1]:.2f} s")
    for name in names:  # the summary
        print(
            f"{name}: switch to it {statistics.median(switch[name]):.2f} s (load "
            f"{statistics.median(load[name]):.2f} s), 1-token request when loaded "
            f"{statistics.median(loaded[name]) * 1000:.0f} ms  [median of {args.switches}]"
        )


if __name__ == "__main__":
    main()
