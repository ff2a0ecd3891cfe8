"""Where and in what precision the model runs: the device and the compute dtype, decided once
from the engine's config and the machine; and how a step's inputs reach that device."""

from __future__ import annotations

import torch

from minivllm.config import EngineConfig
from minivllm.layers.cpu_kernels import cpu_caps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: the one asked for, else ("auto") bf16 on CUDA and on CPUs with
    native bf16, fp32 on other CPUs and for int8 weights (fp32 activations)."""
    if config.dtype not in (None, "auto"):
        return DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16
    if config.quantization == "int8" or not cpu_caps().native_bf16:
        return torch.float32
    return torch.bfloat16


def staged(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """`values` as int64 on `device`; on CUDA through pinned host memory (torch's caching host
    allocator reuses it once the copy has run) and a non-blocking copy, so the host goes on
    building the step while the transfer runs."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
