"""`minivllm bench`: throughput (vs HF transformers), prefix caching on/off, and serving.

Every benchmark prints its numbers, writes them as JSON (`--output`), and can draw a PNG
chart (`--chart`, needs matplotlib). Ratios are measured in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Workload:
    """nano-vllm's throughput benchmark, scaled: random token ids, uniform lengths."""

    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def make(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(self.seed)
        prompts = [
            [rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(*self.input_len))]
            for _ in range(self.num_requests)
        ]
        outputs = [rng.randint(*self.output_len) for _ in range(self.num_requests)]
        return prompts, outputs


@dataclass
class Result:
    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def line(self) -> str:
        return (f"{self.name:>12}: {self.requests} requests, {self.output_tokens} output tokens, "
                f"{self.seconds:.2f} s, {self.tok_per_s:.1f} tok/s")


def machine() -> dict[str, Any]:
    import os

    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def bench_minivllm(llm: Any, prompts: list[list[int]], out_lens: list[int],
                   temperature: float) -> Result:
    from minivllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(out_lens)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens), "ignore_eos: every request must give all its tokens"
    return Result("minivllm", len(prompts), tokens, seconds)


def bench_hf(model_dir: Path, prompts: list[list[int]], out_lens: list[int],
             temperature: float, device: str) -> Result:
    """HF `generate`, one left-padded batch, fp32 on CPU; counts the tokens asked for."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    longest = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts],
                        device=device)
    new = max(out_lens)
    with torch.inference_mode():
        model.generate(ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2,
                       pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=True, temperature=temperature, top_k=0, pad_token_id=pad)
        seconds = time.perf_counter() - start
    return Result("hf", len(prompts), sum(out_lens), seconds)


def bench_llama_cpp(gguf_path: Path, prompts: list[list[int]], out_lens: list[int],
                    temperature: float) -> Result:
    """llama.cpp through llama-cpp-python on the same GGUF, one request after another (its
    high-level API serves one sequence at a time), all cores, sampling at `temperature`."""
    import os

    from llama_cpp import Llama

    longest = max(len(p) + n for p, n in zip(prompts, out_lens))
    model = Llama(model_path=str(gguf_path), n_ctx=longest + 8, n_batch=512,
                  n_threads=os.cpu_count(), seed=0, verbose=False)
    for _ in zip(range(2), model.generate([1, 2, 3], temp=temperature, reset=True)):
        pass  # warm-up
    tokens = 0
    start = time.perf_counter()
    for prompt, n in zip(prompts, out_lens):
        generated = 0
        for _token in model.generate(prompt, temp=temperature, top_k=0, top_p=1.0,
                                     min_p=0.0, reset=True):
            generated += 1  # the raw generator never stops on EOS: ignore_eos
            if generated == n:
                break
        tokens += generated
    seconds = time.perf_counter() - start
    return Result("llama.cpp", len(prompts), tokens, seconds)


def cmd_throughput(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from minivllm import LLM

    workload = Workload(args.num_requests, (args.input_min, args.input_max),
                        (args.output_min, args.output_max), args.seed)
    llm = LLM(**options)
    prompts, out_lens = workload.make(llm.llm_engine.model_runner.vocab_size)
    results = [bench_minivllm(llm, prompts, out_lens, args.temperature)]
    print(results[0].line(), flush=True)
    model_dir = llm.llm_engine.model_runner.model_dir
    device = str(llm.llm_engine.model_runner.device)
    model_option = options.get("model")
    del llm
    if "hf" in args.compare:
        results.append(bench_hf(model_dir, prompts, out_lens, args.temperature, device))
        print(results[-1].line(), flush=True)
    if "llama.cpp" in args.compare:
        from minivllm.models.paths import default_model_path

        gguf = Path(model_option) if model_option else default_model_path()
        if gguf.suffix != ".gguf":
            raise ValueError("--compare llama.cpp needs a .gguf model (or the default model)")
        results.append(bench_llama_cpp(gguf, prompts, out_lens, args.temperature))
        print(results[-1].line(), flush=True)
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "workload": asdict(workload),
        "temperature": args.temperature,
        "machine": machine(),
        "engine_options": {k: v for k, v in options.items()},
        "results": [asdict(r) | {"tok_per_s": r.tok_per_s} for r in results],
    }
    for r in results[1:]:
        ratio = results[0].tok_per_s / r.tok_per_s
        report[f"ratio_vs_{r.name}"] = ratio
        print(f"minivllm / {r.name}: {ratio:.2f}x")
    return report


def cmd_prefix(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """Many requests sharing a long prefix, prefix caching on versus off."""
    from minivllm import LLM, SamplingParams

    rng = random.Random(args.seed)
    results = []
    for enabled in (True, False):
        llm = LLM(**(options | {"enable_prefix_caching": enabled}))
        vocab = llm.llm_engine.model_runner.vocab_size
        rng.seed(args.seed)
        prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_len)]
        prompts = [prefix + [rng.randrange(100, vocab - 100) for _ in range(args.suffix_len)]
                   for _ in range(args.num_requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([prefix[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate(prompts[:1], params, use_tqdm=False)  # the first request fills the cache
        llm.generate(prompts[1:], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        hits = llm.llm_engine.scheduler.block_manager.prefix_hits
        name = "cache on" if enabled else "cache off"
        results.append(Result(name, len(prompts), len(prompts) * args.output_len, seconds))
        print(results[-1].line() + f", prefix-cache hit tokens {hits}", flush=True)
        del llm
    ratio = results[1].seconds / results[0].seconds
    print(f"prefix caching speed-up: {ratio:.2f}x")
    return {"benchmark": "prefix", "machine": machine(), "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len, "output_len": args.output_len,
            "results": [asdict(r) | {"tok_per_s": r.tok_per_s} for r in results],
            "speedup": ratio}


class _TimedRunner:
    """Wraps a ModelRunner to time `run` and, separately, its input preparation."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.num_kv_blocks = runner.num_kv_blocks
        self.vocab_size = runner.vocab_size
        self.run_s = self.prepare_s = 0.0

    def run(self, batch: Any) -> Any:
        from minivllm.engine.model_runner import prepare_inputs

        start = time.perf_counter()
        prepare_inputs(batch, self.runner.block_size, self.runner.device)  # timed alone
        middle = time.perf_counter()
        samples = self.runner.run(batch)
        self.prepare_s += middle - start
        self.run_s += time.perf_counter() - middle
        return samples


def cmd_overhead(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """Engine overhead (schedule + input preparation + postprocess) as a share of step time,
    over decode steps of a batch of `--num-requests` sequences, with the linear layers'
    GFLOP/s beside a plain torch matmul's at the same shapes."""
    import torch

    from minivllm import SamplingParams
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_options(**options)
    timed = _TimedRunner(engine.model_runner)
    engine.model_runner = timed
    rng = random.Random(args.seed)
    vocab = timed.vocab_size
    for i in range(args.num_requests):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(args.input_min,
                                                                             args.input_max))]
        engine.add_request(prompt, SamplingParams(temperature=0.6, seed=i, ignore_eos=True,
                                                  max_tokens=args.output_len + 8))
    while any(s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # prefill everything first
    plan_s = commit_s = 0.0
    timed.run_s = timed.prepare_s = 0.0
    steps = args.output_len
    for _ in range(steps):
        start = time.perf_counter()
        batch = engine.plan()
        middle = time.perf_counter()
        run_before = timed.run_s + timed.prepare_s
        engine.execute_and_commit(batch)
        end = time.perf_counter()
        plan_s += middle - start
        commit_s += (end - middle) - (timed.run_s + timed.prepare_s - run_before)
    overhead = plan_s + timed.prepare_s + commit_s
    step_total = plan_s + timed.run_s + commit_s
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(seq.seq_id)
    print(f"batch {args.num_requests}, {steps} decode steps: step {step_total / steps * 1e3:.1f} ms"
          f" (schedule {plan_s / steps * 1e3:.2f} ms, prepare {timed.prepare_s / steps * 1e3:.2f}"
          f" ms, postprocess {commit_s / steps * 1e3:.2f} ms): overhead "
          f"{100 * overhead / step_total:.1f}% of step time")

    # The linear layers at this decode batch against plain matmuls of the same shapes.
    model = timed.runner.model
    x_rows = args.num_requests
    ours = plain = 0.0
    flops = 0
    linears = [m for m in model.modules() if hasattr(m, "weight") and m.weight.dim() == 2
               and m.weight.shape[0] != vocab]
    with torch.inference_mode():
        for layer in linears[:8]:
            x = torch.randn(x_rows, layer.weight.shape[1], dtype=layer.weight.dtype,
                            device=layer.weight.device)
            w = torch.randn_like(layer.weight)
            layer(x), torch.matmul(x, w.t())  # warm-up
            start = time.perf_counter()
            for _ in range(20):
                layer(x)
            ours += time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(20):
                torch.matmul(x, w.t())
            plain += time.perf_counter() - start
            flops += 20 * 2 * x_rows * layer.weight.shape[0] * layer.weight.shape[1]
    print(f"linear layers at batch {x_rows}: {flops / ours / 1e9:.1f} GFLOP/s; "
          f"plain torch matmul {flops / plain / 1e9:.1f} GFLOP/s ({100 * plain / ours:.0f}%)")
    return {"benchmark": "overhead", "machine": machine(), "batch": args.num_requests,
            "steps": steps, "step_ms": step_total / steps * 1e3,
            "schedule_ms": plan_s / steps * 1e3, "prepare_ms": timed.prepare_s / steps * 1e3,
            "postprocess_ms": commit_s / steps * 1e3,
            "overhead_pct": 100 * overhead / step_total,
            "linear_gflops": flops / ours / 1e9, "matmul_gflops": flops / plain / 1e9,
            "results": [{"name": "linear", "tok_per_s": flops / ours / 1e9},
                        {"name": "matmul", "tok_per_s": flops / plain / 1e9}]}


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh([r["name"] for r in results], [r["tok_per_s"] for r in results], color="#3b6ea5")
    ax.set_xlim(0, 1.18 * max(r["tok_per_s"] for r in results))  # room for the labels
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"minivllm bench {report['benchmark']}")
    for i, r in enumerate(results):
        ax.text(r["tok_per_s"], i, f" {r['tok_per_s']:.1f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", choices=["throughput", "prefix", "serve", "overhead"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-min", type=int, default=32)
    parser.add_argument("--input-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=256)
    parser.add_argument("--gpu-scale", action="store_true",
                        help="nano-vllm's GPU workload: 256 requests, lengths 100-1024")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--compare", nargs="*", default=[], choices=["hf", "llama.cpp"])
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--chart", type=Path, default=None, help="draw a PNG chart here")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="serve: the server to benchmark")


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
    else:
        from minivllm.bench_serve import cmd_serve_bench

        report = cmd_serve_bench(args)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    if args.chart is not None:
        chart(report, args.chart)
    return 0
