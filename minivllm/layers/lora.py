"""LoRA on the linear layers: `y = base(x) + (x @ A.T) @ B.T * scale`, per row's adapter.

A `LoRALinear` sits on one linear layer (`layer.lora`, called by its forward after the base
weight ran, whatever kernel that is: dense, int8, a GGUF's stored blocks). It holds each
resident adapter's A and B by slot; a fused layer (qkv, gate_up) stacks its shards' A along
the rank and places each shard's B in its output rows (a block-diagonal B), so one pair of
matmuls serves all shards. The scale is folded into B at install.

`LoRABatch` is the step's row -> slot map, shared by every `LoRALinear` of the model and set
by the runner before each forward: the rows of one adapter run together (`groups`), the base
rows are left untouched. The MLP may run a long prefill a slice of rows at a time, so each
layer keeps a cursor into the step's rows.
"""

from __future__ import annotations

import torch

# slot -> (A [R, in], B [out, R]) with R the sum of the shards' ranks, B holding the scale
SlotWeights = tuple[torch.Tensor, torch.Tensor]


class LoRABatch:
    """The current step's rows of each adapter slot (empty: no adapter rows)."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, rows; None: all)
        self.cursors: dict[int, int] = {}

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        """`slots[i]`: the adapter slot of row i, -1 for the base model."""
        self.num_rows = len(slots)
        self.cursors.clear()
        self.groups = []
        for slot in sorted(set(slots) - {-1}):
            if all(s == slot for s in slots):
                self.groups.append((slot, None))
                break
            rows = [i for i, s in enumerate(slots) if s == slot]
            self.groups.append((slot, torch.tensor(rows, dtype=torch.int64, device=device)))

    def rows_for(
        self, layer: int, n: int
    ) -> list[tuple[int, torch.Tensor | None, torch.Tensor | None]]:
        """(slot, rows of the step, the same rows within this call's `n`) per adapter group:
        the whole step, or a slice of it starting at the layer's cursor."""
        if n == self.num_rows:
            return [(slot, rows, rows) for slot, rows in self.groups]
        start = self.cursors.get(layer, 0)
        self.cursors[layer] = (start + n) % self.num_rows
        out = []
        for slot, rows in self.groups:
            if rows is None:
                out.append((slot, None, None))
                continue
            inside = rows[(rows >= start) & (rows < start + n)]
            if inside.numel():
                out.append((slot, inside, inside - start))
        return out


class LoRALinear:
    """The adapters of one linear layer; `out_splits`: its fused shards' output rows."""

    def __init__(self, batch: LoRABatch, out_splits: list[int], key: int) -> None:
        self.batch = batch
        self.out_splits = out_splits
        self.key = key  # the layer's cursor in the batch
        self.slots: dict[int, SlotWeights] = {}

    def install(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter in `slot`: per fused shard its (A [r, in], B*scale [rows, r]) or
        None where the adapter leaves that shard alone."""
        present = [s for s in shards if s is not None]
        if not present:
            self.slots.pop(slot, None)
            return
        a = torch.cat([s[0] for s in present])  # [R, in]
        b = torch.zeros(sum(self.out_splits), a.shape[0], dtype=a.dtype, device=a.device)
        row = col = 0
        for rows, shard in zip(self.out_splits, shards, strict=True):
            if shard is not None:
                r = shard[0].shape[0]
                b[row : row + rows, col : col + r] = shard[1]
                col += r
            row += rows
        self.slots[slot] = (a, b)

    def evict(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base output of `x`'s rows) plus each adapter's update on its rows."""
        if not self.batch.groups:
            return out
        result = None
        for slot, _, local in self.batch.rows_for(self.key, x.shape[0]):
            weights = self.slots.get(slot)
            if weights is None:  # this adapter leaves the layer alone
                continue
            a, b = weights
            if result is None:
                result = out.clone()
            if local is None:  # every row: no gather
                result += ((x @ a.T) @ b.T).to(out.dtype)
            else:  # x[local]: [rows, in] -> [rows, R] -> [rows, out]
                result.index_add_(0, local, ((x[local] @ a.T) @ b.T).to(out.dtype))
        return out if result is None else result
