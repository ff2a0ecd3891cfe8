"""The runner's resident LoRA adapters: at most `max_loras`, one slot each, least recently
used evicted first (never one a running request still uses).

Each attention and MLP linear layer gets a `LoRALinear` hook (minivllm.layers.lora); an
adapter's HF modules land in our fused layers: q/k/v in `qkv_proj`'s output slices,
gate/up in `gate_up_proj`'s. Before each forward, `set_batch` maps the step's rows to slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from minivllm.config import EngineConfig
from minivllm.engine.sequence import Sequence
from minivllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from minivllm.layers.lora import LoRABatch, LoRALinear
from minivllm.lora_request import LoRARequest
from minivllm.models.lora_files import LoRAWeights, load_lora

# our layer -> the HF modules it fuses, in output order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SINGLE = ("o_proj", "down_proj")


def _out_splits(layer: LinearBase) -> list[int]:
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.output_sizes)
    return [layer.output_size]


class LoRAManager:
    """Loads adapters into slots of the model's `LoRALinear` hooks and maps rows to slots."""

    def __init__(
        self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype
    ) -> None:
        """`dtype`: the activations' (the update runs in it, whatever the weights' kernel)."""
        self.dtype = dtype
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.batch = LoRABatch(max_loras)
        # HF module name (e.g. model.layers.0.self_attn.q_proj) -> (hook, shard index)
        self.targets: dict[str, tuple[LoRALinear, int, LinearBase]] = {}
        self.hooks: list[LoRALinear] = []
        heads = (0, 0)
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if not isinstance(module, LinearBase) or leaf not in (*FUSED, *SINGLE):
                continue
            if module.tp_size > 1:
                raise ValueError("LoRA adapters with tensor_parallel_size > 1 are not supported")
            hook = LoRALinear(self.batch, _out_splits(module), key=len(self.hooks))
            module.lora = hook
            self.hooks.append(hook)
            parent = name.rsplit(".", 1)[0]
            for i, hf in enumerate(FUSED.get(leaf, (leaf,))):
                self.targets[f"{parent}.{hf}"] = (hook, i, module)
            if isinstance(module, QKVParallelLinear):
                heads = (module.num_heads, module.num_kv_heads)
        self.heads = heads
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.names: dict[int, str] = {}

    def add(self, request: LoRARequest, in_use: Iterable[int] = ()) -> None:
        """Make `request`'s adapter resident (reading its files if it is not), evicting the
        least recently used adapter that no request in `in_use` (their ids) needs."""
        lid = request.lora_int_id
        if lid in self.slots:
            if self.names[lid] != request.lora_name:
                raise ValueError(
                    f"lora_int_id {lid} is LoRA adapter {self.names[lid]!r}, not "
                    f"{request.lora_name!r}: give each adapter its own id"
                )
            self.slots.move_to_end(lid)
            return
        weights = load_lora(request.lora_path, self.max_lora_rank, self.heads)
        shards = self._place(weights)
        if len(self.slots) >= self.max_loras:
            busy = set(in_use)
            victim = next((v for v in self.slots if v not in busy), None)
            if victim is None:
                raise ValueError(
                    f"cannot load LoRA adapter {request.lora_name!r}: all max_loras "
                    f"({self.max_loras}) adapters are in use by running requests"
                )
            self.remove(victim)
        slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        for hook, parts in shards.items():
            hook.install(slot, parts)
        self.slots[lid] = slot
        self.names[lid] = request.lora_name

    def _place(self, weights: LoRAWeights) -> dict[LoRALinear, list]:
        """Each hook's shards of the adapter, shapes checked against the model's layers."""
        shards: dict[LoRALinear, list] = {}
        for name, (a, b) in weights.modules.items():
            if name not in self.targets:
                raise ValueError(f"LoRA adapter {weights.path}: the model has no module {name}")
            hook, i, layer = self.targets[name]
            rows = hook.out_splits[i]
            if a.shape[1] != layer.input_size or b.shape[0] != rows:
                raise ValueError(
                    f"LoRA adapter {weights.path}: {name} has A {tuple(a.shape)} and B "
                    f"{tuple(b.shape)}, the model's layer takes {layer.input_size} inputs and "
                    f"gives {rows} outputs"
                )
            dtype, device = self.dtype, layer.weight.device
            parts = shards.setdefault(hook, [None] * len(hook.out_splits))
            parts[i] = (a.to(device, dtype), (b * weights.scale).to(device, dtype))
        return shards

    def remove(self, lora_int_id: int) -> bool:
        """Evict an adapter; False if it is not resident."""
        slot = self.slots.pop(lora_int_id, None)
        if slot is None:
            return False
        self.names.pop(lora_int_id, None)
        for hook in self.hooks:
            hook.evict(slot)
        return True

    def set_batch(self, seqs: list[Sequence], device: torch.device) -> None:
        """Map the step's rows (each sequence's scheduled tokens, in order) to slots."""
        rows: list[int] = []
        for seq in seqs:
            slot = self.slots.get(seq.lora_int_id, -1) if seq.lora_int_id else -1
            rows.extend([slot] * seq.num_scheduled_tokens)
        self.batch.set_rows(rows, device)


class NoLoRA:
    """The runner's LoRA when `enable_lora` is off: no slots, every row the base model's."""

    def set_batch(self, seqs: list[Sequence], device: torch.device) -> None:
        pass


def lora_manager(
    config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype
) -> LoRAManager | NoLoRA:
    """The runner's adapter slots when `enable_lora`, the `lora_modules` loaded."""
    if not config.enable_lora:
        return NoLoRA()
    manager = LoRAManager(model, config.max_loras, config.max_lora_rank, dtype)
    for i, module in enumerate(config.lora_modules, start=1):
        name, _, path = module.partition("=")
        manager.add(LoRARequest(name, i, path))
    return manager
