"""The typed per-step messages rank 0 sends the other tensor-parallel ranks.

A message is carried by `torch.distributed.broadcast` on the control group (gloo, CPU):

1. a header, `[HEADER_LEN]` int64: `kind, step, num_tokens, num_seqs, max_blocks, num_samples`;
2. for a step only, one int64 payload whose sizes the header gives: input_ids, positions and
   slot_mapping `[T]` each, query_start_loc `[S + 1]`, seq_lens `[S]`, block_tables `[S * B]`
   and logits_indices `[N]`, concatenated.

Every broadcast fills a fresh tensor, so nothing is overwritten while it is read; `step`
numbers the messages 1, 2, 3, ... and a worker that receives any other number than the next
one stops with an error instead of running a step out of order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.layers.attention import AttentionMetadata

HEADER_LEN = 8


class MessageKind(enum.IntEnum):
    STEP = 1
    SHUTDOWN = 2


@dataclass
class StepMessage:
    """What a worker needs to run one step of its shard: the model's inputs, no Sequences."""

    step: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int64
    seq_lens: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, B] int64
    logits_indices: torch.Tensor  # [N] int64: rows whose logits rank 0 samples from

    def attention_metadata(self, block_size: int, device: torch.device) -> AttentionMetadata:
        """The step's AttentionMetadata, as rank 0's ModelRunner builds it."""
        query_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device),
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=self.seq_lens.tolist(),
            block_size=block_size,
        )


@dataclass
class ShutdownMessage:
    """Leave the worker loop and the process group."""

    step: int


Message = StepMessage | ShutdownMessage


def send(message: Message, group: dist.ProcessGroup) -> None:
    """Broadcast `message` from rank 0 to every rank of `group`."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if isinstance(message, ShutdownMessage):
        header[:2] = torch.tensor([MessageKind.SHUTDOWN, message.step])
        dist.broadcast(header, src=0, group=group)
        return
    num_tokens = message.input_ids.numel()
    num_seqs, max_blocks = message.block_tables.shape
    sizes = [
        MessageKind.STEP,
        message.step,
        num_tokens,
        num_seqs,
        max_blocks,
        message.logits_indices.numel(),
    ]
    header[: len(sizes)] = torch.tensor(sizes)
    parts = [
        message.input_ids,
        message.positions,
        message.slot_mapping,
        message.query_start_loc,
        message.seq_lens,
        message.block_tables,
        message.logits_indices,
    ]
    payload = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])
    dist.broadcast(header, src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def receive(group: dist.ProcessGroup, expected_step: int) -> Message:
    """Wait for rank 0's next message; RuntimeError if it is not message `expected_step`."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    kind, step, num_tokens, num_seqs, max_blocks, num_samples = header[:6].tolist()
    if step != expected_step:
        raise RuntimeError(f"tensor-parallel message {step} arrived, expected {expected_step}")
    if kind == MessageKind.SHUTDOWN:
        return ShutdownMessage(step)
    if kind != MessageKind.STEP:
        raise RuntimeError(f"unknown tensor-parallel message kind {kind}")
    sizes = [
        num_tokens,
        num_tokens,
        num_tokens,
        num_seqs + 1,
        num_seqs,
        num_seqs * max_blocks,
        num_samples,
    ]
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    ids, pos, slots, starts, seq_lens, tables, logits = payload.split(sizes)
    return StepMessage(
        step, ids, pos, slots, starts, seq_lens, tables.view(num_seqs, max_blocks), logits
    )  # tables: [S, B]
