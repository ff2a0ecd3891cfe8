"""Decode steps on the default model with the LM head through oneDNN's packed weight (what
minivllm does on the CPU, `DenseHead.process_weights_after_loading`) and through plain `F.linear`.

For batch sizes 4, 16 and 32: random prompts of 64-256 ids, prefilled, then 5 decode steps per
timing, alternating the two ways 4 times; prints the best step time of each and the ratio.
Also prints the LM-head GEMM alone (GFLOP/s) at those sizes.

    .venv/bin/python benchmarks/lm_head.py
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.layers.quantization.head import DenseHead


def best_ms(fn, repeats: int = 5, calls: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    engine = LLM(None).llm_engine
    head = engine.model_runner.model.lm_head
    method = head.method
    assert isinstance(method, DenseHead) and method.packed, "the LM head is not packed here"
    packed = method.packed
    vocab, hidden = head.weight.shape
    with torch.inference_mode():
        for m in (4, 16, 32):
            x = torch.randn(m, hidden)
            flops = 2 * m * hidden * vocab / 1e9
            dense = best_ms(lambda x=x: F.linear(x, head.weight))
            onednn = best_ms(lambda x=x: packed(x))
            print(
                f"LM head GEMM, M={m}: F.linear {flops / dense * 1e3:.1f} GFLOP/s, "
                f"oneDNN packed {flops / onednn * 1e3:.1f} GFLOP/s"
            )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    for batch in (4, 16, 32):
        for _ in range(batch):
            prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(64, 256))]
            engine.add_request(prompt, params)
        engine.step()  # the prefill
        engine.step()
        best: dict[str, float] = {}
        for _ in range(4):
            for name, pack in [("F.linear", None), ("oneDNN", packed)]:
                method.packed = pack
                start = time.perf_counter()
                for _ in range(5):
                    engine.step()
                ms = (time.perf_counter() - start) / 5 * 1e3
                best[name] = min(best.get(name, float("inf")), ms)
        method.packed = packed
        print(
            f"decode step, batch {batch}: F.linear {best['F.linear']:.1f} ms, oneDNN "
            f"{best['oneDNN']:.1f} ms ({best['F.linear'] / best['oneDNN']:.2f}x)",
            flush=True,
        )
        for seq_id in list(engine._requests):
            engine.abort_request(seq_id)


if __name__ == "__main__":
    main()
