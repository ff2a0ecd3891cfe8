"""`minivllm bench`: throughput (vs HF transformers), prefix caching on/off, engine overhead,
serving (alone, or against llama.cpp's server: `peer.py`) and quality (vs HF fp32), one
module per benchmark over the shared workloads of `workloads.py`.

Every benchmark prints its numbers, writes them as JSON (`--output`), and can draw a PNG
chart (`--chart`, needs matplotlib). Ratios are measured in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from minivllm.bench.common import chart
from minivllm.bench.overhead import cmd_overhead
from minivllm.bench.peer import cmd_compare_llama_cpp
from minivllm.bench.prefix import cmd_prefix
from minivllm.bench.quality import cmd_quality
from minivllm.bench.serve import cmd_serve_bench
from minivllm.bench.text_workloads import WORKLOADS
from minivllm.bench.throughput import cmd_throughput


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", choices=["throughput", "prefix", "serve", "overhead", "quality"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-min", type=int, default=32)
    parser.add_argument("--input-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=256)
    parser.add_argument(
        "--gpu-scale",
        action="store_true",
        help="nano-vllm's GPU workload: 256 requests, lengths 100-1024",
    )
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--compare", nargs="*", default=[], choices=["hf", "llama.cpp"])
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument(
        "--decode-chunk",
        type=int,
        default=1,
        help="quality: tokens per step of the decode-sized scoring",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="serve: random token ids (long: --compare llama.cpp's one stream after 2k and "
        "8k-token prompts, 256 tokens), or chat requests through the model's template whose "
        "answers reuse their prompts (grounded), do not (chat), or are a 1k-token Python file "
        "again with a method renamed (edit: --compare llama.cpp runs it at c=1, 400 tokens)",
    )
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--chart", type=Path, default=None, help="draw a PNG chart here")
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="serve: the server to benchmark"
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="serve --compare llama.cpp: llama.cpp's server binary (default: "
        "$LLAMA_SERVER, else benchmarks/build_llama_cpp.sh's build)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="serve --compare llama.cpp: with N > 1 every server is started at once and each "
        "level runs N rounds, the servers taking turns (medians, and each round's ratio); "
        "1: one server after the other",
    )
    parser.add_argument(
        "--llama-spec-type",
        default=None,
        metavar="TYPE",
        help="serve --compare llama.cpp: llama-server's --spec-type (ngram-simple: its "
        "prompt lookup; default: its own, none)",
    )


def run_bench(args: argparse.Namespace, options: dict[str, Any]) -> int:
    if args.gpu_scale:
        args.num_requests, args.input_min, args.input_max = 256, 100, 1024
        args.output_min, args.output_max = 100, 1024
    if args.which == "throughput":
        report = cmd_throughput(args, options)
    elif args.which == "prefix":
        report = cmd_prefix(args, options)
    elif args.which == "overhead":
        report = cmd_overhead(args, options)
    elif args.which == "quality":
        report = cmd_quality(args, options)
    elif "llama.cpp" in args.compare:
        report = cmd_compare_llama_cpp(args, options)
    else:
        report = cmd_serve_bench(args, options)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    if args.chart is not None:
        chart(report, args.chart)
    return 0
