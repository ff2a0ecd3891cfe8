"""LoRA on the linear layers: `y = base(x) + (x @ A.T) @ B.T * scale`, per row's adapter.

A `LoRALinear` sits on one linear layer (`layer.lora`, called by its forward after the base
weight ran, whatever kernel that is: dense, int8, a GGUF's stored blocks). It holds each
resident adapter's A and B by slot; a fused layer (qkv, gate_up) stacks its shards' A along
the rank and places each shard's B in its output rows (a block-diagonal B), so one pair of
matmuls serves all shards. The scale is folded into B at install.

`LoRABatch` is the step's row -> slot map, shared by every `LoRALinear` of the model and set
by the runner before each forward; base rows get an update of exact zeros. The MLP may run a
long prefill a slice of rows at a time, so each layer keeps a cursor into the step's rows.
"""

from __future__ import annotations

import torch

# slot -> (A [R, in], B [out, R]) with R the sum of the shards' ranks, B holding the scale
SlotWeights = tuple[torch.Tensor, torch.Tensor]


class LoRABatch:
    """The current step's adapter slot of each row (-1: the base model)."""

    def __init__(self, max_loras: int = 4) -> None:
        self.max_loras = max_loras  # slots are 0 .. max_loras - 1
        self.num_rows = 0
        self.active = False  # any row under an adapter
        self.rows = torch.empty(0, dtype=torch.int64)  # [num_rows] slot per row
        self.slots: list[int] = []
        self.cursors: dict[int, int] = {}
        # (the layer's rank layout, dtype) -> [num_rows, R_all] own-adapter mask, this step's
        self.masks: dict[tuple, torch.Tensor] = {}
        self.grouped: dict[tuple[int, int], tuple[torch.Tensor, ...] | None] = {}

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        """`slots[i]`: the adapter slot of row i, -1 for the base model."""
        self.num_rows = len(slots)
        self.slots = slots
        self.cursors.clear()
        self.masks.clear()
        self.grouped.clear()
        self.active = any(s >= 0 for s in slots)
        if self.active:
            self.rows = torch.tensor(slots, dtype=torch.int64, device=device)

    def window(self, layer: int, n: int) -> int:
        """The first of the `n` rows a layer is given: the whole step's, or for a slice of it
        (the MLP's slices of a long prefill, in order) the next from the layer's cursor."""
        if n == self.num_rows:
            return 0
        start = self.cursors.get(layer, 0)
        self.cursors[layer] = (start + n) % self.num_rows
        return start

    def own_mask(
        self, start: int, n: int, col_slot: torch.Tensor, layout: tuple, dtype: torch.dtype
    ) -> torch.Tensor:
        """[n, R_all]: 1 where a rank column belongs to the row's own adapter; for the whole
        step made once per layout (most layers share one)."""
        if n == self.num_rows:
            key = (layout, dtype)
            mask = self.masks.get(key)
            if mask is None:
                mask = self.masks[key] = (self.rows[:, None] == col_slot[None, :]).to(dtype)
            return mask
        return (self.rows[start : start + n, None] == col_slot[None, :]).to(dtype)

    def groups(self, start: int, n: int) -> tuple[torch.Tensor, ...] | None:
        """Rows `start .. start + n` grouped by adapter, as the grouped kernel takes them:
        (row order, group starts [G + 1], group slots [G]); None where none has an adapter.
        Made once per window and shared by every layer."""
        key = (start, n)
        if key not in self.grouped:
            members: dict[int, list[int]] = {}
            for row, slot in enumerate(self.slots[start : start + n]):
                if slot >= 0:
                    members.setdefault(slot, []).append(row)
            order = [row for group in members.values() for row in group]
            bounds = [0]
            for group in members.values():
                bounds.append(bounds[-1] + len(group))
            self.grouped[key] = (
                tuple(torch.tensor(v, dtype=torch.int64) for v in (order, bounds, list(members)))
                if members
                else None
            )
        return self.grouped[key]


class LoRALinear:
    """The adapters of one linear layer; `out_splits`: its fused shards' output rows.

    All resident adapters' A are kept stacked (`a_all` [R_all, in], `b_all` [out, R_all],
    `col_slot` [R_all]: the slot of each rank column), so a step with any mix of adapters
    is two matmuls: `x @ a_all.T`, its columns outside each row's own adapter zeroed (base
    rows: all), then `@ b_all.T`. Fewer, larger ops than one gather per adapter: the
    per-op overhead is what a mixed decode step pays for on the CPU. Up to `lora_rows` rows
    (`minivllm.layers.quantization.rows`) our grouped kernel (`csrc/lora.cpp`) runs instead,
    each row through its own adapter only, from float32 copies by slot (`kernel_a` [slots, R,
    in], `kernel_b` [slots, R, out], zero-padded to the largest rank).
    """

    def __init__(self, batch: LoRABatch, out_splits: list[int], key: int) -> None:
        self.batch = batch
        self.out_splits = out_splits
        self.key = key  # the layer's cursor in the batch
        self.slots: dict[int, SlotWeights] = {}
        self.a_all: torch.Tensor | None = None
        self.b_all = self.col_slot = torch.empty(0)
        self.kernel_a: torch.Tensor | None = None  # set where our CPU kernels run
        self.kernel_b = torch.empty(0)
        self.kernel_rows = 0
        self.layout: tuple = ()  # (slot, rank columns) in stacking order

    def install(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter in `slot`: per fused shard its (A [r, in], B*scale [rows, r]) or
        None where the adapter leaves that shard alone."""
        present = [s for s in shards if s is not None]
        if not present:
            self.evict(slot)
            return
        a = torch.cat([s[0] for s in present])  # [R, in]
        b = torch.zeros(sum(self.out_splits), a.shape[0], dtype=a.dtype, device=a.device)
        row = col = 0
        for rows, shard in zip(self.out_splits, shards, strict=True):
            if shard is not None:
                r = shard[0].shape[0]
                b[row : row + rows, col : col + r] = shard[1]  # this shard's output rows
                col += r
            row += rows
        self.slots[slot] = (a, b)
        self._stack()

    def evict(self, slot: int) -> None:
        if self.slots.pop(slot, None) is not None:
            self._stack()

    def _stack(self) -> None:
        if not self.slots:
            self.a_all = None
            return
        order = sorted(self.slots)
        self.layout = tuple((s, self.slots[s][0].shape[0]) for s in order)
        self.a_all = torch.cat([self.slots[s][0] for s in order])  # [R_all, in]
        self.b_all = torch.cat([self.slots[s][1] for s in order], dim=1)  # [out, R_all]
        self.col_slot = torch.cat(
            [torch.full((self.slots[s][0].shape[0],), s, device=self.a_all.device) for s in order]
        )
        self._stack_for_kernel()

    def _stack_for_kernel(self) -> None:
        from minivllm.layers.cpu_kernels import cpu_kernels_available
        from minivllm.layers.quantization.rows import kernel_rows

        assert self.a_all is not None
        if self.a_all.device.type != "cpu" or not cpu_kernels_available():
            return
        rank = max(a.shape[0] for a, _ in self.slots.values())
        a_k = torch.zeros(self.batch.max_loras, rank, self.a_all.shape[1])
        b_k = torch.zeros(self.batch.max_loras, rank, self.b_all.shape[0])
        for slot, (a, b) in self.slots.items():
            a_k[slot, : a.shape[0]] = a.float()
            b_k[slot, : b.shape[1]] = b.float().T
        self.kernel_a, self.kernel_b = a_k, b_k
        self.kernel_rows = kernel_rows().lora_rows

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base output of `x`'s rows) plus each row's adapter update."""
        if not self.batch.active or self.a_all is None:
            return out
        n = x.shape[0]
        start = self.batch.window(self.key, n)
        if self.kernel_a is not None and n <= self.kernel_rows:
            groups = self.batch.groups(start, n)
            if groups is None:
                return out
            return torch.ops.minivllm.lora_rows(x, out, *groups, self.kernel_a, self.kernel_b)
        own = self.batch.own_mask(start, n, self.col_slot, self.layout, x.dtype)
        xa = (x @ self.a_all.T).mul_(own)  # [n, R_all], other adapters' columns zeroed
        return torch.addmm(out, xa.to(out.dtype), self.b_all.T.to(out.dtype))
