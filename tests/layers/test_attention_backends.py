"""The attention path is chosen once per layer, at load, from the layer's fixed facts: the
registry's order (flash-attn, our Triton kernel, our paged decode kernel, SDPA) and what each
supports."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.attention import Attention, flash, triton_attention
from minivllm.layers.attention.backends import SDPA, AttentionSpec, choose_backend
from minivllm.layers.attention.layer import bind_attention_backends

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_flash_needs_cuda_a_half_dtype_and_its_block_multiple(monkeypatch) -> None:
    monkeypatch.setattr(flash, "flash_attn_varlen_func", object())  # as if installed
    monkeypatch.setattr(triton_attention, "triton_available", lambda: False)
    bf16 = torch.bfloat16
    assert choose_backend(AttentionSpec(CUDA, bf16, bf16, 64, 256)).name == "flash"
    assert choose_backend(AttentionSpec(CUDA, bf16, bf16, 64, 16)) is SDPA
    assert choose_backend(AttentionSpec(CUDA, torch.float32, torch.float32, 64, 256)) is SDPA
    assert choose_backend(AttentionSpec(CPU, torch.float32, torch.float32, 64, 256)) is SDPA


def test_without_flash_attn_or_triton_cuda_keeps_sdpa(monkeypatch) -> None:
    monkeypatch.setattr(flash, "flash_attn_varlen_func", None)
    monkeypatch.setattr(triton_attention, "triton_available", lambda: False)
    assert choose_backend(AttentionSpec(CUDA, torch.bfloat16, torch.bfloat16, 64, 256)) is SDPA


def test_cuda_without_flash_attn_takes_triton_for_any_block_size(monkeypatch) -> None:
    """Triton comes after flash-attn (first where it imports) and before the CPU paths: on
    CUDA it takes the block sizes flash-attn cannot, fp32 included, and the int8 and fp8
    caches flash-attn cannot read; head sizes past its 256 and the CPU keep the other
    backends."""
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    bf16 = torch.bfloat16
    monkeypatch.setattr(flash, "flash_attn_varlen_func", object())
    assert choose_backend(AttentionSpec(CUDA, bf16, bf16, 64, 256)).name == "flash"
    for quantized in (torch.int8, torch.float8_e4m3fn):
        assert choose_backend(AttentionSpec(CUDA, bf16, quantized, 64, 256)).name == "triton"
    monkeypatch.setattr(flash, "flash_attn_varlen_func", None)
    for spec in (
        AttentionSpec(CUDA, bf16, bf16, 64, 256),
        AttentionSpec(CUDA, bf16, bf16, 96, 16),
        AttentionSpec(CUDA, torch.float32, torch.float32, 128, 16),
    ):
        assert choose_backend(spec).name == "triton"
    assert choose_backend(AttentionSpec(CUDA, bf16, torch.int8, 512, 16)) is SDPA
    assert choose_backend(AttentionSpec(CPU, torch.float32, torch.float32, 64, 16)) is SDPA


def test_binding_gives_every_layer_its_backend_once() -> None:
    """A layer built alone attends with SDPA; binding sets each layer of a model, and the
    fp32 CPU spec (the token-exact path) keeps SDPA."""
    model = nn.ModuleList([Attention(4, 2, 8, 1.0), Attention(4, 2, 8, 1.0, sliding_window=3)])
    assert all(layer.backend is SDPA for layer in model)
    chosen = bind_attention_backends(model, AttentionSpec(CPU, torch.float32, torch.float32, 8, 4))
    assert chosen == {"sdpa"} and all(layer.backend is SDPA for layer in model)
    assert "backend=sdpa" in repr(model[0])
