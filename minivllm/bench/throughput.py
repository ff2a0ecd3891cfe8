"""`minivllm bench throughput`: offline generation of a random workload, against HF
transformers and llama.cpp (through llama-cpp-python) on the same model."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from minivllm.bench.common import Result, hf_model_dir, machine
from minivllm.bench.workloads import Workload


def bench_minivllm(
    llm: Any, prompts: list[list[int]], out_lens: list[int], temperature: float
) -> Result:
    from minivllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(out_lens)
    ]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens), "ignore_eos: every request must give all its tokens"
    return Result("minivllm", len(prompts), tokens, seconds, cpu)


def bench_hf(
    model_dir: Path, prompts: list[list[int]], out_lens: list[int], temperature: float, device: str
) -> Result:
    """HF `generate`, one left-padded batch, fp32 on CPU; counts the tokens asked for."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    longest = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    new = max(out_lens)
    with torch.inference_mode():
        model.generate(
            ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2, pad_token_id=pad
        )  # warm-up
        start, cpu_start = time.perf_counter(), time.process_time()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            pad_token_id=pad,
        )
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return Result("hf", len(prompts), sum(out_lens), seconds, cpu)


def bench_llama_cpp(
    gguf_path: Path, prompts: list[list[int]], out_lens: list[int], temperature: float
) -> Result:
    """llama.cpp through llama-cpp-python on the same GGUF, one request after another (its
    high-level API serves one sequence at a time), all cores, sampling at `temperature`."""
    import os

    from llama_cpp import Llama

    longest = max(len(p) + n for p, n in zip(prompts, out_lens))
    model = Llama(
        model_path=str(gguf_path),
        n_ctx=longest + 8,
        n_batch=512,
        n_threads=os.cpu_count(),
        seed=0,
        verbose=False,
    )
    for _ in zip(range(2), model.generate([1, 2, 3], temp=temperature, reset=True)):
        pass  # warm-up
    tokens = 0
    start = time.perf_counter()
    for prompt, n in zip(prompts, out_lens):
        generated = 0
        for _token in model.generate(
            prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, reset=True
        ):
            generated += 1  # the raw generator never stops on EOS: ignore_eos
            if generated == n:
                break
        tokens += generated
    seconds = time.perf_counter() - start
    return Result("llama.cpp", len(prompts), tokens, seconds)


def cmd_throughput(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from minivllm import LLM

    workload = Workload(
        args.num_requests,
        (args.input_min, args.input_max),
        (args.output_min, args.output_max),
        args.seed,
    )
    llm = LLM(**options)
    prompts, out_lens = workload.make(llm.llm_engine.model_runner.vocab_size)
    results = [bench_minivllm(llm, prompts, out_lens, args.temperature)]
    print(results[0].line(), flush=True)
    device = str(llm.llm_engine.model_runner.device)
    model_option = options.get("model")
    if "hf" in args.compare:
        reference = hf_model_dir(llm.llm_engine.model_runner)
        del llm
        with reference as model_dir:
            results.append(bench_hf(model_dir, prompts, out_lens, args.temperature, device))
        print(results[-1].line(), flush=True)
    else:
        del llm
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
        "results": [
            asdict(r) | {"tok_per_s": r.tok_per_s, "tok_per_cpu_s": r.tok_per_cpu_s}
            for r in results
        ],
    }
    for r in results[1:]:
        ratio = results[0].tok_per_s / r.tok_per_s
        report[f"ratio_vs_{r.name}"] = ratio
        line = f"minivllm / {r.name}: {ratio:.2f}x"
        if results[0].cpu_seconds and r.cpu_seconds:
            report[f"cpu_ratio_vs_{r.name}"] = r.cpu_seconds / results[0].cpu_seconds
            line += f" (per CPU second: {report[f'cpu_ratio_vs_{r.name}']:.2f}x)"
        print(line)
    return report
