"""The step's logits: computed in slices of the LM head's rows, the prompt rows scored into
prompt logprobs, the sampling rows handed on to the sampler.

Row order (`StepInputs.logits_indices`): first the sampling rows (one per sampling sequence,
or one per draft plus one), then the prompt rows of each `prompt_logprob_runs` entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from minivllm.engine.sequence import Sequence
from minivllm.layers.sampler import gather_logprobs
from minivllm.logprobs import Logprob

LOGITS_ROWS = 512  # logits computed per LM-head call: 512 x 49k x 4 B = 100 MB for SmolLM2

# seq_id -> (first prompt position covered, one {token_id: Logprob} per position)
PromptLogprobs = dict[int, tuple[int, list[dict[int, Logprob]]]]


def compute_logits_in_slices(
    model: Any, hidden: torch.Tensor, indices: torch.Tensor
) -> Iterator[torch.Tensor]:
    """The logits of `hidden[indices]`, LOGITS_ROWS rows per LM-head call (a long prompt's
    prompt logprobs would not fit at once). Every tensor-parallel rank makes the same calls,
    so the LM head's collectives meet."""
    for start in range(0, indices.numel(), LOGITS_ROWS):
        yield model.compute_logits(hidden[indices[start : start + LOGITS_ROWS]])


def joined_logits(slices: Iterable[torch.Tensor]) -> torch.Tensor:
    """The slices' logits as one `[rows, V]` tensor: one slice as it is, not copied (16 rows of
    Gemma 3's 262k logits: 0.8 ms a step)."""
    parts = list(slices)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def score_prompt_rows(
    slices: Iterator[torch.Tensor],
    runs: list[tuple[Sequence, int, int]],
    num_samples: int,
    into: PromptLogprobs,
) -> torch.Tensor | None:
    """Score the prompt rows of `runs` ((sequence, first position, count), in row order) slice
    by slice into `into`; return the samples' logits (the first `num_samples` rows), None if
    there are none."""
    sample_parts, row = [], 0
    targets = [  # (seq, position) of every prompt row, in row order
        (seq, first + k) for seq, first, count in runs for k in range(count)
    ]
    for logits in slices:
        n = logits.shape[0]
        take = max(0, min(n, num_samples - row))
        if take:
            sample_parts.append(logits[:take])
        if take < n:
            lps = logits[take:].log_softmax(dim=-1)  # [rows, V]
            rows = targets[row + take - num_samples : row + n - num_samples]
            tokens = torch.tensor([seq.token_ids[pos] for seq, pos in rows], device=lps.device)
            wants = [seq.sampling_params.prompt_logprobs for seq, _ in rows]
            for (seq, pos), entry in zip(rows, gather_logprobs(lps, tokens, wants)):
                into.setdefault(seq.seq_id, (pos, []))[1].append(entry)
        row += n
    return joined_logits(sample_parts) if sample_parts else None
