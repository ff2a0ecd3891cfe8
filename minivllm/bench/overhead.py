"""`minivllm bench overhead`: the engine's own time (schedule, input preparation,
postprocess) as a share of a decode step, and the linear layers against plain matmuls."""

from __future__ import annotations

import argparse
import time
from typing import Any

from minivllm.bench.common import machine
from minivllm.bench.workloads import Workload


class _TimedRunner:
    """Wraps a ModelRunner to time `run` and, separately, its input preparation."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.num_kv_blocks = runner.num_kv_blocks
        self.vocab_size = runner.vocab_size
        self.run_s = self.prepare_s = 0.0

    def run(self, batch: Any, token_bitmask: Any = None) -> Any:
        from minivllm.engine.model_runner import prepare_inputs

        start = time.perf_counter()
        # timed alone
        prepare_inputs(batch, self.runner.block_size, self.runner.device, token_bitmask)
        middle = time.perf_counter()
        output = self.runner.run(batch, token_bitmask)
        self.prepare_s += middle - start
        self.run_s += time.perf_counter() - middle
        return output


def _prefill_requests(engine: Any, args: argparse.Namespace, vocab: int) -> None:
    """Add the workload's requests and step until every prompt is prefilled."""
    from minivllm import SamplingParams

    workload = Workload(args.num_requests, (args.input_min, args.input_max), (1, 1), args.seed)
    for i, prompt in enumerate(workload.make(vocab)[0]):
        engine.add_request(
            prompt,
            SamplingParams(
                temperature=0.6, seed=i, ignore_eos=True, max_tokens=args.output_len + 8
            ),
        )
    while (
        any(s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()


def cmd_overhead(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """Engine overhead (schedule + input preparation + postprocess) as a share of step time,
    over decode steps of a batch of `--num-requests` sequences, with the linear layers'
    GFLOP/s beside a plain torch matmul's at the same shapes."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.runtime.output_processor import OutputProcessor

    engine = LLMEngine.from_options(**options)
    processor = OutputProcessor(engine)  # postprocess includes the outputs' text, as served
    timed = _TimedRunner(engine.model_runner)
    engine.model_runner = timed
    vocab = timed.vocab_size
    _prefill_requests(engine, args, vocab)
    plan_s = commit_s = 0.0
    timed.run_s = timed.prepare_s = 0.0
    steps = args.output_len
    for _ in range(steps):
        start = time.perf_counter()
        batch = engine.plan()
        middle = time.perf_counter()
        run_before = timed.run_s + timed.prepare_s
        processor.process(engine.execute_and_commit(batch))
        end = time.perf_counter()
        plan_s += middle - start
        commit_s += (end - middle) - (timed.run_s + timed.prepare_s - run_before)
    overhead = plan_s + timed.prepare_s + commit_s
    step_total = plan_s + timed.run_s + commit_s
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(seq.seq_id)
    print(
        f"batch {args.num_requests}, {steps} decode steps: step {step_total / steps * 1e3:.1f} ms"
        f" (schedule {plan_s / steps * 1e3:.2f} ms, prepare {timed.prepare_s / steps * 1e3:.2f}"
        f" ms, postprocess {commit_s / steps * 1e3:.2f} ms): overhead "
        f"{100 * overhead / step_total:.1f}% of step time"
    )

    gflops, matmul_gflops = _linear_gflops(timed.runner.model, args.num_requests, vocab)
    return {
        "benchmark": "overhead",
        "machine": machine(),
        "batch": args.num_requests,
        "steps": steps,
        "step_ms": step_total / steps * 1e3,
        "schedule_ms": plan_s / steps * 1e3,
        "prepare_ms": timed.prepare_s / steps * 1e3,
        "postprocess_ms": commit_s / steps * 1e3,
        "overhead_pct": 100 * overhead / step_total,
        "linear_gflops": gflops,
        "matmul_gflops": matmul_gflops,
        "results": [
            {"name": "linear", "tok_per_s": gflops},
            {"name": "matmul", "tok_per_s": matmul_gflops},
        ],
    }


def _linear_gflops(model: Any, rows: int, vocab: int) -> tuple[float, float]:
    """GFLOP/s of the model's first linear layers at `rows` rows, and of plain torch matmuls
    of the same shapes."""
    import torch

    ours = plain = 0.0
    flops = 0
    linears = [
        m
        for m in model.modules()
        if hasattr(m, "weight") and m.weight.dim() == 2 and m.weight.shape[0] != vocab
    ]
    with torch.inference_mode():
        for layer in linears[:8]:
            x = torch.randn(
                rows, layer.weight.shape[1], dtype=layer.weight.dtype, device=layer.weight.device
            )
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
            flops += 20 * 2 * rows * layer.weight.shape[0] * layer.weight.shape[1]
    print(
        f"linear layers at batch {rows}: {flops / ours / 1e9:.1f} GFLOP/s; "
        f"plain torch matmul {flops / plain / 1e9:.1f} GFLOP/s ({100 * plain / ours:.0f}%)"
    )
    return flops / ours / 1e9, flops / plain / 1e9
