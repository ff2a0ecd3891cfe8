"""Where a decode step's time goes: torch.profiler over decode steps of the default model.

Prefills `--batch` random prompts of `--context` tokens, then profiles `--steps` decode steps
and prints the ms per step of the top ops and of three buckets: the linear layers (dense and
packed int4 matmuls), the LM head, and everything else (norms, rotary, attention, copies).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_profile.py [--batch 1] [--dtype auto]
        [--enforce-eager]   # the eager step, for comparison with the compiled one
        [--wall-rounds 6]   # also the wall time a step takes: min and median of the rounds

The wall time (all of torch's threads; sampling at `--temperature`, 0.6 by default, where the
serve benchmark's client asks 0: greedy) is what a user waits for; the CPU time sums the
threads' work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.workloads import Workload
from minivllm.config import SPECULATION_OFF

MATMUL_OPS = (
    "aten::_weight_int4pack_mm_for_cpu",
    "minivllm::ggml",
    "aten::linear",
    "aten::addmm",
    "aten::mm",
    "aten::matmul",
    "quantized::linear_dynamic",
    "mkldnn::",
    "aten::_weight_int8pack_mm",
    "minivllm::qgemv",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a model path or GGUF file (default: the default model)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument(
        "--wall-rounds",
        type=int,
        default=0,
        help="rounds of --steps steps timed by the wall clock (0: none)",
    )
    args = parser.parse_args()
    # every sequence's whole context resident (16 tokens a block, the default): a pool too
    # small for the batch preempts some and times a smaller step than asked
    max_tokens = (2 + args.wall_rounds) * args.steps + 8
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        num_kv_blocks=max(512, args.batch * (-(-(args.context + max_tokens) // 16) + 1)),
        enforce_eager=args.enforce_eager,
        speculative_config=SPECULATION_OFF,  # one-token steps: what this script measures
    )
    engine = llm.llm_engine
    prompts, _ = Workload(args.batch, (args.context, args.context), (1, 1)).make(
        engine.model_runner.vocab_size
    )
    for prompt in prompts:
        engine.add_request(
            prompt,
            SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                temperature=args.temperature,
            ),
        )
    while (
        any(s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()  # warm-up decodes
    if len(engine.scheduler.running) != args.batch:
        raise SystemExit(f"only {len(engine.scheduler.running)} of {args.batch} sequences run")
    start = time.process_time()  # CPU time: on a shared machine the wall clock is its load
    for _ in range(args.steps):
        engine.step()
    wall = (time.process_time() - start) / args.steps * 1e3
    rounds = []
    for _ in range(args.wall_rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        rounds.append((time.perf_counter() - start) / args.steps * 1e3)
    if rounds:
        print(
            f"wall ms per step over {len(rounds)} rounds of {args.steps}: min "
            f"{min(rounds):.1f}, median {statistics.median(rounds):.1f}"
        )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    per_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_op[event.key] += event.self_cpu_time_total / 1e3 / args.steps
    runner = engine.model_runner
    print(
        f"{'eager' if runner.compiled_decode is None else 'compiled'} step, "
        f"batch {args.batch}, context {args.context}, dtype {runner.dtype}, KV "
        f"{runner.kv_dtype}: {wall:.1f} CPU ms per decode step unprofiled "
        f"({args.batch / wall * 1e3:.1f} tok/s)"
    )
    matmul = sum(ms for op, ms in per_op.items() if op.startswith(MATMUL_OPS))
    total = sum(per_op.values())
    print(
        f"profiled self time per step: {total:.1f} ms; matmuls {matmul:.1f} ms, "
        f"other ops {total - matmul:.1f} ms"
    )
    for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms:7.2f} ms  {op}")
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.seq_id)


if __name__ == "__main__":
    main()
