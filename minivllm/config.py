"""The engine's options, vLLM's names where they exist, frozen after construction.

Values that depend on the model (for example `max_model_len` when not given) are resolved
once, by building a new config with `dataclasses.replace`; nothing writes to a config later.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of one engine. Pure Python; no torch import here."""

    model: str | None = None  # HF directory or .gguf file; None = the default model
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # most sequences RUNNING at once
    max_num_batched_tokens: int = 4096  # token budget of one step (decodes + prefill chunks)
    max_model_len: int | None = None  # prompt + completion limit; None = the model's own
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # override the KV pool size (tiny pools force preemption)
    kv_cache_memory_gb: float | None = None  # KV budget on CPU; None = a share of free RAM
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use
    device: str | None = None  # "cpu" or "cuda"; None = cuda when available
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None = fp32 on CPU, bf16 on CUDA
    seed: int = 0
    tensor_parallel_size: int = 1
    quantization: str | None = None  # "int8": int8 weights for the linear layers (CPU)
    eos_token_ids: tuple[int, ...] = ()  # filled from the model when the engine is built

    def __post_init__(self) -> None:
        positive = ["block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ["max_model_len", "num_kv_blocks"]:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}"
            )

        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build a config from keyword options, rejecting unknown names with a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**options)  # type: ignore[arg-type]
