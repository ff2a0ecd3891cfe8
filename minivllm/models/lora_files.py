"""Read a LoRA adapter from disk: a PEFT folder or a llama.cpp LoRA GGUF.

Either way the result is a `LoRAWeights`: per base-model linear module (HF names, e.g.
`model.layers.0.self_attn.q_proj`) its `A` `[r, in]` and `B` `[out, r]`, and the one scale
the update is multiplied by (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA). Every refusal is a
ValueError naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The linear layers an adapter may target: the attention and MLP projections.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# llama.cpp's tensor names of those layers (`blk.N.<name>.weight.lora_a`).
GGUF_TARGETS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoRAWeights:
    path: str
    rank: int
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])


def load_lora(path: str | Path, max_rank: int, heads: tuple[int, int] = (0, 0)) -> LoRAWeights:
    """The adapter at `path` (a PEFT folder or a `.gguf`), its rank checked against
    `max_rank`; ValueError naming the file when it cannot be used. `heads`: the base model's
    (query, KV) heads, to undo llama.cpp's rotary row order in a GGUF's q and k `B`."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"LoRA adapter {p}: no such file or folder")
    weights = _load_gguf(p, heads) if p.is_file() else _load_peft(p)
    if weights.rank > max_rank:
        raise ValueError(
            f"LoRA adapter {p}: rank {weights.rank} is over max_lora_rank ({max_rank})"
        )
    return weights


def _read_config(folder: Path) -> dict:
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"LoRA adapter {folder}: adapter_config.json is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise ValueError(f"LoRA adapter {cfg_path}: 'r' must be a positive integer")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {cfg_path}: {key} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {cfg_path}: only LoRA A/B weights are supported")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {cfg_path}: DoRA is not supported")
    return cfg


def _load_peft(folder: Path) -> LoRAWeights:
    from safetensors.torch import load_file

    cfg = _read_config(folder)
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        raise ValueError(
            f"LoRA adapter {folder}: unknown target module(s) {unknown}; supported: {TARGETS}"
        )
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {folder}: adapter_model.safetensors is missing")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {file}: unexpected tensor {key!r}")
        parts.setdefault(m.group(1), {})[m.group(2)] = tensor.float()
    r, alpha = cfg["r"], float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoRAWeights(str(folder), r, scale, _pairs(file, parts, r))


def _pairs(
    file: Path, parts: dict[str, dict[str, torch.Tensor]], r: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Check each module has an A `[r, in]` and a B `[out, r]` and a known target."""
    modules = {}
    for name, ab in parts.items():
        if name.rsplit(".", 1)[-1] not in TARGETS:
            raise ValueError(f"LoRA adapter {file}: unknown target module {name!r}")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {file}: {name} needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"LoRA adapter {file}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"expected [r={r}, in] and [out, r={r}]"
            )
        modules[name] = (a, b)
    if not modules:
        raise ValueError(f"LoRA adapter {file}: no LoRA weights")
    return modules


def _load_gguf(file: Path, heads: tuple[int, int]) -> LoRAWeights:
    """A llama.cpp LoRA (convert_lora_to_gguf.py): `general.type` adapter, `adapter.type`
    lora, `adapter.lora.alpha`; tensors `blk.N.<name>.weight.lora_a` / `.lora_b`."""
    import gguf

    from minivllm.models.gguf import unpermute_qk

    try:
        reader = gguf.GGUFReader(str(file))
    except (ValueError, OSError) as e:
        raise ValueError(f"LoRA adapter {file}: not a readable GGUF file ({e})") from None

    def field(name: str) -> object:
        f = reader.fields.get(name)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {file}: not a LoRA GGUF (general.type/adapter.type)")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    n_head = {"attn_q": heads[0], "attn_k": heads[1]}
    for t in reader.tensors:
        m = re.match(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$", t.name)
        if m is None or m.group(2) not in GGUF_TARGETS:
            raise ValueError(f"LoRA adapter {file}: unknown tensor {t.name!r}")
        layer, kind, which = m.groups()
        data = t.data.reshape(*reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if which == "b" and n_head.get(kind):  # llama.cpp's rotary row order, back to HF's
            data = unpermute_qk(data, n_head[kind])
        tensor = torch.from_numpy(data.copy()).float()
        name = f"model.layers.{layer}.{GGUF_TARGETS[kind]}"
        parts.setdefault(name, {})["A" if which == "a" else "B"] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {file}: no LoRA weights")
    r = next(iter(parts.values()))["A"].shape[0]
    alpha = field("adapter.lora.alpha")
    scale = (float(alpha) if alpha else float(r)) / r  # type: ignore[arg-type]
    return LoRAWeights(str(file), r, scale, _pairs(file, parts, r))
