"""`minivllm bench quality`: how far an engine configuration is from HF transformers in fp32.

On a fixed English text (`QUALITY_TEXT`, written for this project) it scores every token
teacher-forced, through the engine's own paths, against HF transformers running the same
model in float32 (for a GGUF: the converter's fp32 dequantization of the same file):

- perplexity, ours against HF's (the relative difference, in percent);
- top-1 agreement: the share of positions where our most likely next token is HF's.

The engine scores the text through `prompt_logprobs`, twice: as one prefill (prefill-sized
matmuls) and in chunks of `decode_chunk` tokens (decode-sized matmuls: with int4 weights the
packed kernel), so both kernels of a layer are judged. A user judges an option with e.g.
`minivllm bench quality --dtype bfloat16 --quantization none`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from minivllm.bench.common import hf_model_dir, machine

QUALITY_TEXT = (
    "The town library opens at nine in the morning, but the queue starts forming long before "
    "that. Students come first, carrying laptops and cold coffee, hoping to claim the tables "
    "near the windows. Later the retired engineers arrive to read the newspapers, and by noon "
    "the children's corner is full of parents reading picture books aloud. The librarians "
    "know most of the visitors by name. They remember who prefers detective stories, who is "
    "learning Spanish, and who has been waiting three months for the new history of the "
    "railways.\n\n"
    "A river begins as rain. Water falls on the hills, soaks into the soil and runs down "
    "through small streams that join one another in the valleys. Along the way the river "
    "carries sand and stones, cutting its bed deeper every year. Near the sea it slows down, "
    "drops the finer mud and spreads into a wide delta where birds feed in the shallow water. "
    "Farmers have always settled near rivers, because the land there is flat and fertile, "
    "although floods can destroy a season's work in a single night.\n\n"
    "Learning to cook is mostly learning to pay attention. A good cook watches the colour of "
    "the onions, listens to the oil and tastes the sauce before adding more salt. Recipes "
    "help at the beginning, but after a while the measurements matter less than the habits: "
    "keeping the knife sharp, cleaning as you go and giving the pan enough time to heat. The "
    "best meals are often simple ones, made with fresh vegetables, a little bread and "
    "friends around the table.\n\n"
    "Every computer program is a list of instructions, but writing a useful one takes more "
    "than knowing the instructions. The programmer has to understand the problem, choose a "
    "way to represent the data and test the result against cases that are easy to forget, "
    "such as an empty list or a very long name. Clear names and short functions make the "
    "code easier to read for the next person, who is often the same programmer a year later."
)


def hf_reference(model_dir: Path, token_ids: list[int]) -> tuple[list[float], list[int]]:
    """HF transformers fp32 on `token_ids`: (log-prob of each token after the first, the
    argmax next token at each of those positions)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()  # [T - 1, V]
    logprobs = logits.log_softmax(-1)
    targets = torch.tensor(token_ids[1:])
    own = logprobs.gather(-1, targets[:, None])[:, 0]  # [T - 1]
    return own.tolist(), logprobs.argmax(-1).tolist()


def engine_scores(
    llm: Any, token_ids: list[int], chunk: int | None
) -> tuple[list[float], list[int]]:
    """The engine's log-prob of each token after the first and its top-1 next token at each
    of those positions, the text scored in steps of `chunk` tokens (None: one prefill)."""
    from dataclasses import replace

    from minivllm import SamplingParams
    from minivllm.engine.llm_engine import LLMEngine

    base = llm.llm_engine
    budget = max(len(token_ids), base.config.max_num_batched_tokens) if chunk is None else chunk
    # A second engine on the same loaded model; its token budget sets the step size.
    engine = LLMEngine(
        replace(base.config, max_num_batched_tokens=budget), base.model_runner, base.tokenizer
    )
    engine.add_request(token_ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    entries = outputs[-1].prompt_logprobs[1:]  # one dict per token after the first
    own = [entry[token].logprob for entry, token in zip(entries, token_ids[1:], strict=True)]
    top1 = [next(t for t, lp in entry.items() if lp.rank == 1) for entry in entries]
    return own, top1


def compare(
    own: list[float], top1: list[int], ref_own: list[float], ref_top1: list[int]
) -> dict[str, float]:
    """Perplexities, their relative difference (%) and the top-1 agreement (%)."""
    ppl = math.exp(-sum(own) / len(own))
    ref_ppl = math.exp(-sum(ref_own) / len(ref_own))
    agree = sum(a == b for a, b in zip(top1, ref_top1, strict=True)) / len(top1)
    return {
        "perplexity": ppl,
        "hf_perplexity": ref_ppl,
        "perplexity_delta_pct": 100 * (ppl / ref_ppl - 1),
        "top1_agreement_pct": 100 * agree,
    }


def measure_quality(
    llm: Any, text: str = QUALITY_TEXT, decode_chunk: int = 1, max_tokens: int | None = None
) -> dict[str, Any]:
    """Quality of `llm` against HF fp32 on `text` (its first `max_tokens` tokens when set):
    `{"tokens", "prefill": {...}, "decode": {...}}`, each with `compare`'s fields."""
    token_ids = llm.llm_engine.tokenizer.encode(text)[:max_tokens]
    with hf_model_dir(llm.llm_engine.model_runner) as model_dir:
        ref_own, ref_top1 = hf_reference(model_dir, token_ids)
    report: dict[str, Any] = {"tokens": len(token_ids)}
    for name, chunk in (("prefill", None), ("decode", decode_chunk)):
        own, top1 = engine_scores(llm, token_ids, chunk)
        report[name] = compare(own, top1, ref_own, ref_top1)
    return report


def cmd_quality(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from minivllm import LLM

    llm = LLM(**options)
    runner = llm.llm_engine.model_runner
    report = measure_quality(llm, decode_chunk=args.decode_chunk)
    print(
        f"{report['tokens']} tokens, dtype {runner.dtype}, HF fp32 perplexity "
        f"{report['prefill']['hf_perplexity']:.3f}"
    )
    for name in ("prefill", "decode"):
        r = report[name]
        print(
            f"{name:>8}: perplexity {r['perplexity']:.3f} ({r['perplexity_delta_pct']:+.2f}% "
            f"vs HF fp32), top-1 agreement {r['top1_agreement_pct']:.1f}%"
        )
    return {
        "benchmark": "quality",
        "machine": machine(),
        "engine_options": options,
        "dtype": str(runner.dtype),
        **report,
        "results": [
            {"name": f"{name} top-1 %", "tok_per_s": report[name]["top1_agreement_pct"]}
            for name in ("prefill", "decode")
        ],
    }
