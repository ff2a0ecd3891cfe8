"""Build a model from an HF-style directory (config.json + *.safetensors) and load its weights.

Checkpoint names map to parameters explicitly: a name whose module is listed in the model's
`packed_modules_mapping` (e.g. `q_proj`) goes to a shard of the fused parameter
(`qkv_proj`, shard "q"); every other name must equal a parameter name. Each parameter's
`weight_loader` copies (and casts) the tensor in.
"""

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from minivllm.models.registry import get_model_class
from minivllm.startup import phase

logger = logging.getLogger(__name__)

PackedMapping = dict[str, tuple[str, int | str]]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_rank: int = 0,
    tp_size: int = 1,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    attach: Callable[[nn.Module], set[str]] | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Read `model_dir/config.json`, build the model in `dtype` on `device`, load its weights
    (this rank's shard of them when `tp_size > 1`): `weights` (checkpoint name, tensor) when
    given (a GGUF's), else the directory's safetensors. `attach(model)`, run before loading,
    gives layers weights of another form and returns the checkpoint names it supplied, which
    `weights` then need not hold.

    Returns `(model, hf_config)` with the model in eval mode and no parameter requiring grad.
    Raises `FileNotFoundError` for a missing config or weights, `ValueError` for an unsupported
    architecture or for weights that are missing or of the wrong shape.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    model_cls = get_model_class(hf_config)
    # Allocate parameters directly in the target dtype and device: no float32 copy on the side.
    with phase("loading the weights"):
        with _default_dtype(dtype), torch.device(device):
            model = model_cls(hf_config, tp_size=tp_size, tp_rank=tp_rank)
        supplied = attach(model) if attach is not None else set()
        load_weights(model, iter_safetensors(model_dir) if weights is None else weights, supplied)
    model.requires_grad_(False)
    return model.eval(), hf_config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's `.safetensors` files: those named by the shard index if there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(checkpoint name, tensor)` for every tensor, one file at a time, on the CPU."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_to_param_name(name: str, packed: PackedMapping) -> tuple[str, int | str | None]:
    """Map a checkpoint name to `(parameter name, shard id or None)`.

    `model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, "k").
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in packed:
            fused, shard_id = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None


def expected_checkpoint_names(model: nn.Module, packed: PackedMapping) -> set[str]:
    """Every checkpoint name the model needs: one per parameter, one per shard of fused ones."""
    shards_of: dict[str, list[str]] = {}
    for ckpt_module, (fused, _) in packed.items():
        shards_of.setdefault(fused, []).append(ckpt_module)
    expected = set()
    for name, _ in model.named_parameters():  # tied parameters are listed once
        parts = name.split(".")
        fused_at = [i for i, part in enumerate(parts[:-1]) if part in shards_of]
        if not fused_at:
            expected.add(name)
            continue
        i = fused_at[0]
        for ckpt_module in shards_of[parts[i]]:
            expected.add(".".join([*parts[:i], ckpt_module, *parts[i + 1 :]]))
    return expected


def _is_ignored(name: str, tied: bool) -> bool:
    """Checkpoint entries we deliberately skip."""
    if name.endswith("rotary_emb.inv_freq"):  # derived from the config, saved by old exports
        return True
    return tied and name == "lm_head.weight"  # tied: the embedding is the head


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    supplied: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Copy checkpoint tensors into `model`'s parameters through their weight loaders;
    `supplied` names the ones already given to the model in another form (skipped).

    Raises `ValueError` listing the checkpoint names the model needs but did not receive.
    Unknown names are logged and skipped.
    """
    packed: PackedMapping = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for ckpt_name, tensor in weights:
            if _is_ignored(ckpt_name, tied) or ckpt_name in supplied:
                continue
            param_name, shard_id = checkpoint_to_param_name(ckpt_name, packed)
            param = params.get(param_name)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            weight_loader = getattr(param, "weight_loader", None)
            try:
                if weight_loader is not None:
                    weight_loader(param, tensor, shard_id)
                elif shard_id is None and param.shape == tensor.shape:
                    param.data.copy_(tensor)
                else:
                    raise ValueError(
                        f"shape mismatch: parameter expects {tuple(param.shape)}, "
                        f"got {tuple(tensor.shape)}"
                    )
            except ValueError as error:
                raise ValueError(f"cannot load checkpoint weight {ckpt_name!r}: {error}") from error
            loaded.add(ckpt_name)
    if unexpected:
        logger.warning("ignored %d unknown checkpoint weights: %s", len(unexpected), unexpected)
    missing = sorted(expected_checkpoint_names(model, packed) - loaded - supplied)
    if missing:
        shown = ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set torch's default floating dtype (model construction only)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
