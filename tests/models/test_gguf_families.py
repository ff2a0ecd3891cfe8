"""GGUF files of the newer families, written as llama.cpp's converter writes them, converted back
and run by the engine.

Each tiny HF checkpoint is written with the `gguf` package under llama.cpp's own tensor names
(`gguf.get_tensor_name_map`, an independent reference for our table), with llama.cpp's
changes: Gemma's norm weights stored as `1 + w`, Mistral as `llama` with q/k rows permuted,
Phi-3's fused qkv and gate_up, its LongRoPE factors as tensors. Guards: the architecture
table, every tensor name, the undone changes, the metadata each config needs (windows,
soft-caps, Gemma 3's layer pattern and rope bases, Phi-3's factors) and the engine's greedy
tokens on the converted model against HF generate on the original.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.gguf_files import gguf_writer
from support.model_fixtures import build_tokenizer, family_configs
from transformers import AutoConfig, AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.models import gguf as mgguf
from minivllm.models.gguf_file import GGUFFile

PROMPTS = [[5, 17, 42, 99, 3, 8], list(range(10, 50))]  # the second outgrows every window
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _write(
    path: Path,
    model: torch.nn.Module,
    arch: str,
    *,
    permute: bool = False,
    norm_shift: float = 0.0,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    head_dim_key: bool = True,
) -> None:
    """`model` as llama.cpp's converter writes architecture `arch`."""
    cfg = model.config
    head_dim = cfg.head_dim
    writer = gguf_writer(path, arch, cfg)
    if head_dim_key:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if extra is not None:
        extra(writer)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        w = tensor.detach().numpy().astype(np.float32)
        if permute and ".q_proj." in name:
            w = mgguf.permute_qk(w, cfg.num_attention_heads)
        elif permute and ".k_proj." in name:
            w = mgguf.permute_qk(w, cfg.num_key_value_heads)
        if norm_shift and name.endswith("norm.weight"):
            w = w + np.float32(norm_shift)
        stem, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gemma_meta(cfg, softcaps: bool) -> Callable[[gguf.GGUFWriter], None]:
    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(cfg.sliding_window)
        if softcaps:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:  # Gemma 3: the layer pattern and the global rope's linear scaling
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])

    return extra


def _phi3_meta(cfg, factors: dict | None) -> Callable[[gguf.GGUFWriter], None]:
    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(cfg.sliding_window or 0)
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if factors is not None:
            writer.add_tensor("rope_factors_long.weight", np.array(factors["long"], np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(factors["short"], np.float32))

    return extra


LONGROPE = {
    "short": [round(1 + 0.1 * i, 2) for i in range(8)],
    "long": [2 + 0.5 * i for i in range(8)],
}


def _case(name: str) -> tuple[torch.nn.Module, str, dict]:
    """(HF model, GGUF architecture, writer options) of each case."""
    tokenizer = build_tokenizer()
    config, model_cls, seed = family_configs(tokenizer)[name.split("-")[0]]
    if name.startswith("gemma"):
        config.query_pre_attn_scalar = config.head_dim  # what llama.cpp assumes (not 27B)
    if name in ("mistral", "qwen2"):  # llama.cpp keeps no window for these (Qwen2.5 has none)
        config.sliding_window = None
        config.use_sliding_window = False
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    if name == "phi3-longrope":
        config.max_position_embeddings, config.original_max_position_embeddings = 128, 32
        config.rope_parameters = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
            "long_factor": LONGROPE["long"],
            "short_factor": LONGROPE["short"],
        }
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    options: dict = {
        "qwen2": dict(arch="qwen2"),
        "mistral": dict(arch="llama", permute=True),
        "gemma2": dict(arch="gemma2", norm_shift=1.0, extra=_gemma_meta(config, True)),
        "gemma3": dict(arch="gemma3", norm_shift=1.0, extra=_gemma_meta(config, False)),
        "phi3": dict(arch="phi3", head_dim_key=False, extra=_phi3_meta(config, None)),
        "phi3-longrope": dict(arch="phi3", head_dim_key=False, extra=_phi3_meta(config, LONGROPE)),
    }[name]
    return model, options.pop("arch"), options


CASES = ["qwen2", "mistral", "gemma2", "gemma3", "phi3", "phi3-longrope"]


@pytest.mark.parametrize("case", CASES)
def test_family_gguf_converts_and_generates_like_hf(tmp_path: Path, case: str) -> None:
    original, arch, options = _case(case)
    original_dir = tmp_path / "hf"
    original.save_pretrained(original_dir)
    _write(tmp_path / "m.gguf", original, arch, **options)

    out = mgguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "converted")
    build_tokenizer().save_pretrained(out)  # these files carry no tokenizer
    config = AutoConfig.from_pretrained(out)
    want_arch = "LlamaForCausalLM" if case == "mistral" else type(original).__name__
    assert config.architectures == [want_arch]
    for key in (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "layer_types",
        "tie_word_embeddings",
        "head_dim",
    ):
        if hasattr(original.config, key) and case != "mistral":
            assert getattr(config, key) == getattr(original.config, key), key
    if case == "gemma3" or case == "phi3-longrope":
        assert config.rope_parameters == original.config.rope_parameters

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want, got = original.state_dict(), converted.state_dict()
    assert set(got) == set(want)
    for name in want:  # Gemma's (w + 1) - 1 rounds in float32
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)

    prompts = PROMPTS[:1] if case == "mistral" else PROMPTS  # (no window: short prompts only)
    if case == "phi3-longrope":  # HF switches to the long factors past 32 tokens only
        prompts = PROMPTS[1:]
    llm = LLM(str(out), dtype="float32", max_model_len=96, max_num_batched_tokens=16)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with torch.inference_mode():
        theirs = [
            original.generate(
                torch.tensor([p]),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    assert ours == theirs
    shutil.rmtree(tmp_path / "converted")


def test_gemma3_default_layer_pattern_and_27b_scale(tmp_path: Path) -> None:
    """Without a pattern key, llama.cpp's: five sliding layers, then a full one. The 27B
    models (62 layers) scale q by hidden / heads, every other size by head_dim."""
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    for key, value in [
        ("block_count", 62),
        ("context_length", 512),
        ("embedding_length", 5376),
        ("feed_forward_length", 128),
        ("attention.head_count", 32),
        ("attention.head_count_kv", 16),
        ("attention.key_length", 128),
        ("attention.sliding_window", 1024),
    ]:
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1e6)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = mgguf.build_config(GGUFFile(tmp_path / "g.gguf"))
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.layer_types.count("full_attention") == 10
    assert config.query_pre_attn_scalar == 5376 // 32
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
