"""What Dynamo sees of a decoder layer when the compiled decode step traces it
(`compiled_decode.py`): which sizes are constants and which guards are checked at each step.

Every size Dynamo traces as a symbol costs tracing time at every start and may add guards
that split one graph into several; the step's own sizes (tokens, sequences, context length,
the pool's number of blocks) are the only ones that change.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.layers.attention.kv_quant import KVCache


def keep_guards_on_values(entries: list[Any]) -> list[bool]:
    """Which of a graph's guards to check before each call: not those on a layer's weights
    or on the layer object itself (they never change once loaded, and dropping them lets
    every layer share one graph), but those on its plain values, which can differ between
    layers (Gemma's sliding-window and full-attention layers: two graphs where the window is a
    constant, the gathered path's; the paged kernel reads it as data, one graph)."""
    return [
        not (
            entry.orig_guard.source.is_unspecialized_nn_module()
            and entry.has_value
            and isinstance(entry.value, torch.Tensor | torch.nn.Module)
        )
        for entry in entries
    ]


def mark_weights_static(layer: torch.nn.Module) -> None:
    """Trace every tensor the layer holds with its sizes as constants: its parameters, and the
    GGUF blocks its linear methods keep in plain objects and lists. They have the same sizes
    in every layer and step; under `dynamic=True` each size became a symbol with guards, and
    tracing those symbols was a large share of a warm start's compile (docs/performance.md)."""
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 8:  # a layer's blocks sit 6 levels down
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            torch._dynamo.mark_static(value)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, torch.nn.Module):
            for item in (*value._parameters.values(), *value._buffers.values()):
                visit(item, depth + 1)
            for child in value.children():
                visit(child, depth + 1)
            for name, item in vars(value).items():
                if not name.startswith("_"):  # a linear layer's `method`, say
                    visit(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for item in vars(value).values():  # a method's weight, a weight's `_blocks`
                visit(item, depth + 1)

    visit(layer, 0)


def mark_cache_sizes_static(kv_caches: list[KVCache]) -> None:
    """Trace a KV cache's sizes past its number of blocks (block size, KV heads, head dim)
    as constants. As symbols they filled the graph with guards on their products, and the
    view of a step's new K/V as [S, KVH, D] specialised the graph on one sequence (a second
    graph for steps of several). The number of blocks stays a symbol: one graph (and one
    Inductor cache entry) serves a pool of any size."""
    for cache in kv_caches:
        for tensor in cache:
            for dim in range(1, tensor.dim()):
                torch._dynamo.mark_static(tensor, dim)
