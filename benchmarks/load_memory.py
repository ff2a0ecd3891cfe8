"""Start-up time, resident memory and disk written when loading a model, first and second
load, each in a fresh process with an empty cache directory of its own.

    .venv/bin/python benchmarks/load_memory.py MODEL.gguf [--tokens 32] [--engine-arg KEY=VALUE]
    .venv/bin/python benchmarks/load_memory.py MODEL.gguf --code /path/to/other/checkout

`--code` runs another checkout's minivllm (a `git worktree` of an older commit) with this
venv, for a before/after comparison.

Prints one line per load: seconds from process start to ready (the first request answered
included), resident memory after load (VmRSS) and at its peak (VmHWM), bytes written under
the cache directory, and the decode speed of one short greedy request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
start = time.perf_counter()
from minivllm import LLM, SamplingParams

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
llm = LLM(model=sys.argv[1], **json.loads(sys.argv[3]))
loaded = time.perf_counter()
rss_loaded = status("VmRSS")
params = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0))
ready = time.perf_counter()
out = llm.generate(["The history of the city begins"], params, use_tqdm=False)
decode_s = time.perf_counter() - ready
tokens = len(out[0].outputs[0].token_ids)
print(json.dumps({"load_s": loaded - start, "ready_s": ready - start, "rss_loaded": rss_loaded,
                  "rss_peak": status("VmHWM"), "rss_after_decode": status("VmRSS"),
                  "decode_tok_s": tokens / decode_s}))
"""


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def load_once(model: str, cache: Path, tokens: int, engine_args: dict, code: Path | None) -> dict:
    env = dict(os.environ, MINIVLLM_CACHE=str(cache))
    if code is not None:  # `python -c` puts the working directory first on sys.path
        env["PYTHONPATH"] = str(code)
    before = tree_bytes(cache)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(tokens), json.dumps(engine_args)],
        env=env,
        capture_output=True,
        text=True,
        cwd=code,
    )
    if proc.returncode:
        sys.exit(f"load failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["cache_bytes_written"] = tree_bytes(cache) - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an LLM(...) option, the value read as JSON where it parses",
    )
    parser.add_argument(
        "--code",
        type=Path,
        default=None,
        help="the checkout whose minivllm to run (default: this one)",
    )
    args = parser.parse_args()
    engine_args = {}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_args[key] = value
    size = Path(args.model).stat().st_size if Path(args.model).is_file() else 0
    print(f"{args.model}: file {size / 1e6:.0f} MB")
    with tempfile.TemporaryDirectory(prefix="minivllm-cache-") as tmp:
        for which in ("first", "second"):
            r = load_once(args.model, Path(tmp), args.tokens, engine_args, args.code)
            print(
                f"{which:>6} load: ready in {r['ready_s']:.1f} s (weights loaded at "
                f"{r['load_s']:.1f} s), RSS {r['rss_loaded'] / 1e9:.2f} GB after load, "
                f"{r['rss_after_decode'] / 1e9:.2f} GB after answering, "
                f"peak {r['rss_peak'] / 1e9:.2f} GB, cache written "
                f"{r['cache_bytes_written'] / 1e6:.1f} MB, decode {r['decode_tok_s']:.1f} tok/s",
                flush=True,
            )
            print(json.dumps({"load": which, "model": args.model} | r), flush=True)


if __name__ == "__main__":
    main()
