"""The GPU benchmark's parts, each run by `benchmarks/gpu.sh` in a process of its own (with its
own timeout, so that a slow part still leaves the others' figures):

    python benchmarks/gpu_bench.py throughput MODEL_DIR  # nano-vllm's workload: output tok/s
    python benchmarks/gpu_bench.py steps MODEL_DIR       # median decode step at 256/64/1 seqs,
                                                         # and where a 256-seq step's time goes
    python benchmarks/gpu_bench.py hf MODEL_DIR          # HF generate on a slice, for a ratio

The workload is nano-vllm's benchmark's shape: 256 requests, input and output lengths uniform
in 100-1024 (seed 0, `minivllm.bench.workloads.Workload`), `ignore_eos`, temperature 0.6, on
random weights of a real model's shapes (`make_random_model.py qwen3-0.6b`). The throughput
part prints its running rate every 10 s, so a part cut short by its timeout still says how
fast it went.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.workloads import Workload

WORKLOAD = Workload(256, (100, 1024), (100, 1024), seed=0)
ENGINE = dict(
    device="cuda",
    dtype="bfloat16",
    max_num_seqs=256,
    max_num_batched_tokens=16384,
    max_model_len=4096,
)


def make_llm(model: str, **options) -> LLM:
    start = time.perf_counter()
    llm = LLM(model, **{**ENGINE, **options})
    runner = llm.llm_engine.model_runner
    print(
        f"engine up in {time.perf_counter() - start:.1f} s: attention "
        f"{sorted(runner.attention_backends)}, CUDA graphs "
        f"{'on' if runner.cuda_graphs is not None else 'off'}, {runner.num_kv_blocks} KV blocks",
        flush=True,
    )
    return llm


def throughput(model: str) -> None:
    llm = make_llm(model)
    engine = llm.llm_engine
    prompts, outputs = WORKLOAD.make(engine.model_runner.vocab_size)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    seqs = [
        engine.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
        for p, n in zip(prompts, outputs, strict=True)
    ]
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            done = sum(s.num_tokens - s.num_prompt_tokens for s in seqs)
            print(f"  ... {done} tokens in {last - start:.0f} s", flush=True)
    elapsed = time.perf_counter() - start
    total = sum(outputs)
    print(
        f"throughput: {len(prompts)} requests, {total} output tokens in {elapsed:.1f} s: "
        f"{total / elapsed:.0f} output tok/s",
        flush=True,
    )


def _decode_batch(llm: LLM, num_seqs: int, context: int, steps: int) -> list:
    """`num_seqs` requests of `context`-token prompts, prefilled; room for `steps` more."""
    engine = llm.llm_engine
    prompts, _ = Workload(num_seqs, (context, context), (1, 1), seed=1).make(
        engine.model_runner.vocab_size
    )
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 4)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.scheduler.waiting or any(
        s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    return seqs


def steps(
    model: str, context: int = 512, num_steps: int = 30, sizes: tuple[int, ...] = (256, 64, 1)
) -> None:
    llm = make_llm(model)
    engine = llm.llm_engine
    for num_seqs in sizes:
        seqs = _decode_batch(llm, num_seqs, context, num_steps + 10)
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()  # ends with the sampled ids on the host: the step is done
            times.append(time.perf_counter() - start)
        median = statistics.median(times) * 1e3
        print(
            f"decode step, {num_seqs} seqs, context {context}: median {median:.2f} ms "
            f"({num_seqs / median * 1e3:.0f} tok/s)",
            flush=True,
        )
        if num_seqs == sizes[0]:
            profile(engine)
        for seq in seqs:
            engine.abort_request(seq.seq_id)


def profile(engine, num_steps: int = 5, top: int = 15) -> None:
    """Where a step's time goes: the ops with the most GPU (then CPU) time per step."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(num_steps):
            engine.step()
    device: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device[event.key] += getattr(event, "self_device_time_total", 0) / 1e3 / num_steps
        host[event.key] += event.self_cpu_time_total / 1e3 / num_steps
    print(
        f"  per step: GPU {sum(device.values()):.2f} ms, host {sum(host.values()):.2f} ms; "
        "top ops by GPU time (ms GPU / ms host):"
    )
    for op, ms in sorted(device.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.3f} {host[op]:8.3f}  {op[:90]}")


def hf(model: str, slice_size: int = 32, new_tokens: int = 128) -> None:
    """HF `generate` against the engine on the same slice: the first `slice_size` prompts,
    `new_tokens` each (HF's batch is padded: one length for all)."""
    from transformers import AutoModelForCausalLM

    prompts, _ = WORKLOAD.make(151936)
    prompts = prompts[:slice_size]
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left-padded, as decoder-only generation needs
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True)
    args.update(temperature=0.6, top_k=0, pad_token_id=0)
    hf_model.generate(ids[:1, -8:].cuda(), attention_mask=mask[:1, -8:].cuda(), max_new_tokens=4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf_model.generate(ids.cuda(), attention_mask=mask.cuda(), **args)
    torch.cuda.synchronize()
    hf_rate = len(prompts) * new_tokens / (time.perf_counter() - start)
    del hf_model
    torch.cuda.empty_cache()
    llm = make_llm(model, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    ours = len(prompts) * new_tokens / (time.perf_counter() - start)
    print(
        f"HF generate, {len(prompts)} prompts x {new_tokens} tokens: {hf_rate:.0f} tok/s; "
        f"minivllm {ours:.0f} tok/s: {ours / hf_rate:.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["throughput", "steps", "hf"])
    parser.add_argument("model", help="the random model's directory")
    args = parser.parse_args()
    {"throughput": throughput, "steps": steps, "hf": hf}[args.part](args.model)


if __name__ == "__main__":
    main()
