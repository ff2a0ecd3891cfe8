"""The ModelRunner's inputs of one step, as plain lists: what chapter 06 shows and grades.

They are built by the runner's own `prepare_inputs` from the very plan the runner executed
(the runner never changes a Sequence, so rebuilding them right after it ran gives the same
tensors), and each decode's read slots by its `slot_mapping_for`. torch is imported only
when a step runs: the runner behind the lab has loaded it already.
"""

from __future__ import annotations

from typing import Any


def step_inputs(batch: Any, block_size: int) -> dict[str, Any]:
    """input_ids, positions, slot_mapping, query/sequence lengths, block tables (one row per
    sequence, padded with 0), the logits rows, and the KV slots each sequence's attention
    reads (positions 0 .. seq_len - 1)."""
    import torch

    from minivllm.engine.model_runner import prepare_inputs, slot_mapping_for

    inputs = prepare_inputs(batch, block_size, torch.device("cpu"))
    meta = inputs.meta
    seq_lens = list(meta.seq_lens_cpu)
    return {
        "seq_ids": [s.seq_id for s in batch.seqs],
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": meta.slot_mapping.tolist(),
        "query_lens": list(meta.query_lens_cpu),
        "seq_lens": seq_lens,
        "block_tables": meta.block_tables.tolist(),
        "logits_indices": inputs.logits_indices.tolist(),
        "sample_seq_ids": [s.seq_id for s in batch.sample_seqs],
        "read_slots": [
            slot_mapping_for(list(s.block_table), 0, n, block_size)
            for s, n in zip(batch.seqs, seq_lens)
        ],
    }
