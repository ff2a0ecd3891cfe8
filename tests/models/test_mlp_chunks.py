"""A long prefill's rows go through the MLP a slice at a time on the CPU (so that no
`[T, 2 * intermediate]` activation is larger than the heap's budget, minivllm/heap.py): the
same output as one piece."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from minivllm import heap
from minivllm.models.llama import LlamaMLP


def test_a_long_prefill_runs_the_mlp_in_slices_with_the_same_output(monkeypatch) -> None:
    config = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = LlamaMLP(config)
    torch.manual_seed(0)
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(50, 64)
    whole = mlp(x)
    calls: list[int] = []
    up = mlp.gate_up_proj.forward
    monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda t: calls.append(len(t)) or up(t))
    # 2 * 96 outputs of 4 bytes a row: 16 rows' worth a slice
    monkeypatch.setattr(heap, "_block_budget", 16 * 2 * 96 * 4)
    sliced = mlp(x)
    assert calls == [16, 16, 16, 2]
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
    calls.clear()
    mlp(x[:16])  # within one slice's bytes: one piece
    assert calls == [16]
