"""Pooling an embedding request's final hidden states (the model's output before the LM head,
HF's `last_hidden_state`) into one vector, chunk by chunk.

A long prompt is prefilled in chunks over several steps, so each step pools the rows it has:
mean pooling carries a running fp32 sum of the rows so far (`Sequence.pooled`, kept by the
commit and reset by preemption), cls pooling keeps position 0's row, last pooling needs only
the row of the final chunk. The step that runs a prompt's last token finishes the pool:
divide (mean), L2-normalize if asked, and hand the vector back as a list of floats.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence


def pool_chunk(
    method: str, state: torch.Tensor | None, rows: torch.Tensor, start: int
) -> torch.Tensor | None:
    """The pool's state after `rows` ([n, hidden]: positions start .. start+n-1) given the
    state over the positions before (None at start 0)."""
    if method == "mean":
        chunk = rows.float().sum(dim=0)  # [hidden]
        return chunk if state is None else state + chunk
    if method == "cls":
        return rows[0].float() if start == 0 else state
    return rows[-1].float()  # last: the latest row so far


def finish_pool(method: str, state: torch.Tensor, num_tokens: int, normalize: bool) -> list[float]:
    """The pooled vector of a prompt of `num_tokens` tokens from its final state."""
    vector = state / num_tokens if method == "mean" else state
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    return vector.cpu().tolist()


def pool_batch(
    batch: ScheduledBatch, hidden: torch.Tensor
) -> tuple[dict[int, Any], dict[int, list[float]]]:
    """(partial pools, final vectors) by seq_id for the embedding sequences of the plan;
    `hidden` [num_tokens, hidden] holds the plan's rows, sequence by sequence, in order."""
    partial: dict[int, Any] = {}
    final: dict[int, list[float]] = {}
    row = 0
    for seq in batch.seqs:
        n = seq.num_scheduled_tokens
        if seq.pooling is not None:
            _pool_seq(seq, hidden[row : row + n], partial, final)  # [n, hidden]
        row += n
    return partial, final


def _pool_seq(
    seq: Sequence, rows: torch.Tensor, partial: dict[int, Any], final: dict[int, list[float]]
) -> None:
    assert seq.pooling is not None and seq.pooling.method is not None
    method, start = seq.pooling.method, seq.num_cached_tokens
    state = pool_chunk(method, seq.pooled, rows, start)
    if start + seq.num_scheduled_tokens < seq.num_tokens:
        partial[seq.seq_id] = state
        return
    assert state is not None  # a prompt's chunks cover position 0
    final[seq.seq_id] = finish_pool(method, state, seq.num_tokens, seq.pooling.normalize)
