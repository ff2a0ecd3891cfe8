"""Text workloads for `bench serve`: chat requests whose answers do or do not reuse their
prompts, tokenized through the model's own chat template.

- `grounded`: a pasted document and a task whose answer repeats spans of it (copy it, quote
  the sentences about something, edit code and print it whole, summarise with quotations):
  the requests prompt lookup was made for.
- `chat`: open questions with no document, so the answer shares little with the prompt:
  where speculation must cost next to nothing.

The same seed gives the same requests, so every server in a comparison sees the same prompts.
"""

from __future__ import annotations

import random
from typing import Any

DOCUMENTS = [
    """The KV cache is split into fixed-size blocks. Each request owns a block table: the list
of physical blocks that hold its keys and values, in order. The scheduler decides, every step,
which requests run and how many tokens each of them brings; the block manager gives each
request the blocks its plan needs, and takes them back when the request finishes or is
preempted. A block whose tokens are all committed gets a hash of its content and of the blocks
before it, so a later request with the same prefix reuses it instead of computing it again.""",
    """Minutes of the planning meeting, Tuesday 14 March. Present: Ana (chair), Bruno, Chen,
Dalia. The release moves from the 20th to the 27th because the installer still fails on
machines without a network. Bruno will fix the installer by Friday. Chen reported that the
nightly tests take 41 minutes; the goal is under 20, and Dalia will split the slow suite into
its own job. The budget for new test machines was approved. Next meeting: Tuesday 21 March at
ten, in the small room on the second floor.""",
    """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result""",
    """Our lightweight tent weighs 1.2 kilograms and sleeps two people. The outer shell is
ripstop nylon with a waterproof coating rated at 3000 millimetres, and the floor is rated at
5000. It pitches in about four minutes with a single hubbed pole. There are two doors, two
vestibules and four inside pockets. The tent packs down to 40 by 12 centimetres. It comes with
eight aluminium stakes and a repair kit, and it carries a five-year warranty.""",
    """To bake the bread, mix 500 grams of flour, 350 grams of warm water, 10 grams of salt
and 7 grams of dried yeast in a large bowl. Knead the dough for ten minutes until it is smooth.
Cover it and let it rise for one hour, or until it has doubled in size. Shape it into a loaf,
place it in a tin and let it rise for another thirty minutes. Bake at 220 degrees for thirty
five minutes, until the crust is brown and the loaf sounds hollow when tapped underneath.""",
]

GROUNDED_TASKS = [
    "Repeat the following text exactly, word for word, and nothing else.\n\n{doc}",
    "Quote, word for word, every sentence of the following text that contains a number. "
    "Write one sentence per line.\n\n{doc}",
    "Copy the following text, then add one line at the end that says what it is about.\n\n{doc}",
    "Summarise the following text as a list, quoting its own words wherever you can.\n\n{doc}",
    "Fix any mistakes in the following text and print the whole corrected text.\n\n{doc}",
]

QUESTIONS = [
    "Write a short poem about the sea at night.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me five ideas for a birthday party for a friend who loves hiking.",
    "What are the pros and cons of working from home?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I start learning to play the guitar?",
    "Describe your ideal weekend in a few sentences.",
    "What should I pack for a week-long trip to the mountains?",
]

WORKLOADS = ("random", "grounded", "chat")


def text_requests(workload: str, count: int, seed: int) -> list[str]:
    """`count` user messages of the `grounded` or `chat` workload, the same for the same seed."""
    rng = random.Random(seed)
    if workload == "grounded":
        return [rng.choice(GROUNDED_TASKS).format(doc=rng.choice(DOCUMENTS)) for _ in range(count)]
    if workload == "chat":
        return [rng.choice(QUESTIONS) for _ in range(count)]
    raise ValueError(f"unknown text workload {workload!r}; known: grounded, chat")


def text_prompts(tokenizer: Any, workload: str, count: int, seed: int) -> list[list[int]]:
    """`text_requests` as prompt token ids through the tokenizer's chat template."""
    from minivllm.engine.requests import chat_prompt

    return [
        chat_prompt(tokenizer, [{"role": "user", "content": message}], add_generation_prompt=True)
        for message in text_requests(workload, count, seed)
    ]


def bench_tokenizer(model: str | None) -> Any:
    """The tokenizer of a model path as the engine reads it (a .gguf file or an HF
    directory; None: the default model)."""
    from pathlib import Path

    from minivllm.models.gguf import build_tokenizer
    from minivllm.models.paths import default_model_path
    from minivllm.tokenizer import load_tokenizer

    path = Path(model or default_model_path()).expanduser()
    return build_tokenizer(path) if path.suffix.lower() == ".gguf" else load_tokenizer(path)
