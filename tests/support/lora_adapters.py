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
