"""PEFT adapters for the LoRA tests, made with PEFT itself on the tiny checkpoint, and the
reference they are checked against: PEFT's `merge_and_unload()` model, decoded greedily."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

# (name, LoraConfig kwargs): different ranks and targets, one rsLoRA, one on the MLP only
ADAPTERS = [
    ("qv4", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    (
        "all8",
        dict(
            r=8,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
            + ["down_proj"],
        ),
    ),
    ("mlp2", dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])),
]


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, **lora: object) -> Path:
    """Save a PEFT adapter of `base_dir` with random A and B (PEFT starts B at zero, which
    would make every adapter the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@torch.inference_mode()
def merged_greedy(base_dir: Path, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of the base model with the adapter merged in by PEFT (None: the base)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
    )
    return out[0, len(prompt) :].tolist()


def random_lora(
    shapes: dict[str, tuple[int, int]], r: int, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A and B for each module name -> (in, out), random (scale 0.3)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(r, i, generator=gen) * 0.3, torch.randn(o, r, generator=gen) * 0.3)
        for name, (i, o) in shapes.items()
    }


def write_peft_files(
    out_dir: Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], r: int, alpha: float
) -> Path:
    """A PEFT adapter folder as `save_pretrained` writes it, from given A and B."""
    import json

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for name, (a, b) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf_lora(
    path: Path,
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float,
    heads: tuple[int, int],
) -> Path:
    """The same A and B as a llama.cpp LoRA GGUF, laid out as convert_lora_to_gguf.py writes
    it (q and k `B` rows in llama.cpp's rotary order)."""
    import gguf

    from minivllm.models.gguf import permute_qk

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, (a, b) in modules.items():
        layer = name.split(".")[2]
        kind = GGUF_NAMES[name.split(".", 3)[3]]
        b_np = b.numpy()
        if kind in ("attn_q", "attn_k"):
            b_np = permute_qk(b_np, heads[0] if kind == "attn_q" else heads[1])
        writer.add_tensor(f"blk.{layer}.{kind}.weight.lora_a", a.numpy().copy())
        writer.add_tensor(f"blk.{layer}.{kind}.weight.lora_b", b_np.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
