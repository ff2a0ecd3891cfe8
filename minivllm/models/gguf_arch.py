"""What each llama.cpp architecture of a GGUF file means in HF terms.

For every supported `general.architecture`: the HF model and config classes, llama.cpp's tensor
names (the shared table plus the architecture's own), how llama.cpp changed the weights when it
wrote them (q/k rows permuted for `llama`; Gemma's norm weights stored as `1 + w`), and the
config fields its metadata carries. `gguf.py` reads the tensors; this module names them and
builds the config.

Mistral checkpoints are written by llama.cpp as `llama` (without their sliding window, which
llama.cpp ignores too) and come back as Llama.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minivllm.models.gguf_file import GGUFFile


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, tensor or metadata)."""


_REQUIRED = object()


def meta(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    """One metadata value (scalars unwrapped, arrays as lists)."""
    found = reader.metadata.get(key)
    if found is None:
        if default is _REQUIRED:
            raise GGUFConversionError(
                f"{reader.path}: GGUF metadata lacks the required key {key!r}"
            )
        return default
    return found


def meta_float(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06);
    `default` as is when the key is absent."""
    value = meta(reader, key, None)
    if value is None:
        return meta(reader, key, default)
    return float(str(np.float32(value)))


# ---------------------------------------------------------------------------------------------
# Tensor names
# ---------------------------------------------------------------------------------------------

GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feed-forward one there.
_GEMMA_TENSOR_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Phi-3's checkpoint fuses q/k/v and gate/up; llama.cpp keeps them fused (gate_up as ffn_up).
_PHI3_TENSOR_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

# Tensors that carry configuration, not weights: read into the config, not the state dict.
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


# ---------------------------------------------------------------------------------------------
# Per-architecture config fields
# ---------------------------------------------------------------------------------------------


def _query_pre_attn_scalar(reader: GGUFFile, arch: str, kwargs: dict, layers_27b: int) -> int:
    """GGUF does not store it: llama.cpp scales q by head_dim ** -0.5, except in the 27B
    models (hidden / heads), which it recognises by their layer count, as here."""
    if kwargs["num_hidden_layers"] == layers_27b:
        return kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return kwargs["head_dim"]


def _gemma2_fields(reader: GGUFFile, arch: str, kwargs: dict) -> dict[str, Any]:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(reader, arch, kwargs, 46),
        "sliding_window": int(meta(reader, f"{arch}.attention.sliding_window")),
        "attn_logit_softcapping": meta_float(reader, f"{arch}.attn_logit_softcapping", None),
        "final_logit_softcapping": meta_float(reader, f"{arch}.final_logit_softcapping", None),
    }


def _gemma3_fields(reader: GGUFFile, arch: str, kwargs: dict) -> dict[str, Any]:
    layers = kwargs["num_hidden_layers"]
    # llama.cpp's default is five sliding layers, then a full one; newer files list them.
    pattern = meta(reader, f"{arch}.attention.sliding_window_pattern", None)
    if not isinstance(pattern, list):
        pattern = [(i + 1) % 6 != 0 for i in range(layers)]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": kwargs["rope_theta"]}
    if meta(reader, f"{arch}.rope.scaling.type", "none") == "linear":
        full = {
            **full,
            "rope_type": "linear",
            "factor": meta_float(reader, f"{arch}.rope.scaling.factor"),
        }
    local_theta = meta_float(reader, f"{arch}.rope.freq_base_swa", 10000.0)
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(reader, arch, kwargs, 62),
        "sliding_window": int(meta(reader, f"{arch}.attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in pattern],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": full,
        },
        "final_logit_softcapping": meta_float(reader, f"{arch}.final_logit_softcapping", None),
    }


def _floats(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that round to them (1.1, not 1.100000023)."""
    return [float(str(np.float32(x))) for x in values]


def _phi3_fields(reader: GGUFFile, arch: str, kwargs: dict) -> dict[str, Any]:
    window = int(meta(reader, f"{arch}.attention.sliding_window", 0))
    fields: dict[str, Any] = {
        "sliding_window": window or None,  # llama.cpp writes 0 for none
        "original_max_position_embeddings": int(
            meta(
                reader,
                f"{arch}.rope.scaling.original_context_length",
                kwargs["max_position_embeddings"],
            )
        ),
    }
    factors = {t.name: t for t in reader.tensors if t.name in CONFIG_TENSORS}
    if "rope_factors_long.weight" in factors:
        fields["rope_parameters"] = {
            "rope_type": "longrope",
            "rope_theta": kwargs["rope_theta"],
            "partial_rotary_factor": 1.0,
            "long_factor": _floats(factors["rope_factors_long.weight"].data),
            "short_factor": _floats(factors["rope_factors_short.weight"].data),
        }
    return fields


@dataclass(frozen=True)
class ArchSpec:
    """How one llama.cpp architecture maps to HF."""

    hf_architecture: str  # config.architectures[0], a class of minivllm's registry
    config_class: str  # the transformers config class
    permute_qk: bool = False  # llama.cpp reordered q/k rows for its interleaved rotary
    norm_shift: float = 0.0  # llama.cpp stored every `*norm.weight` plus this
    tensor_names: dict[str, str] = field(default_factory=dict)  # over LAYER_TENSOR_NAMES
    has_attention_bias_field: bool = False  # the config class takes `attention_bias`
    fields: Callable[[GGUFFile, str, dict], dict[str, Any]] | None = None


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        "LlamaForCausalLM", "LlamaConfig", permute_qk=True, has_attention_bias_field=True
    ),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "Qwen3Config", has_attention_bias_field=True),
    "gemma2": ArchSpec(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        norm_shift=1.0,
        tensor_names=_GEMMA_TENSOR_NAMES,
        fields=_gemma2_fields,
    ),
    "gemma3": ArchSpec(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        norm_shift=1.0,
        tensor_names=_GEMMA_TENSOR_NAMES,
        fields=_gemma3_fields,
    ),
    "phi3": ArchSpec(
        "Phi3ForCausalLM", "Phi3Config", tensor_names=_PHI3_TENSOR_NAMES, fields=_phi3_fields
    ),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture(reader: GGUFFile) -> str:
    """The file's `general.architecture`; GGUFConversionError if it is not supported."""
    arch = meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFConversionError(
            f"{reader.path}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def layer_tensor_names(arch: str) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> HF module paths, for `arch`."""
    return {**LAYER_TENSOR_NAMES, **ARCHITECTURES[arch].tensor_names}


def build_config(reader: GGUFFile) -> Any:
    """The transformers config of the file's architecture, built from its metadata."""
    import transformers

    arch = architecture(reader)
    spec = ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}
    n_head = int(meta(reader, f"{arch}.attention.head_count"))
    hidden = int(meta(reader, f"{arch}.embedding_length"))
    head_dim = meta(reader, f"{arch}.attention.key_length", None)
    if head_dim is None:
        head_dim = meta(reader, f"{arch}.rope.dimension_count", hidden // n_head)
    vocab = meta(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(embed.shape[1])  # GGUF shape is [hidden, vocab]
    kwargs: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(head_dim),
        "rms_norm_eps": meta_float(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": int(meta(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": meta(reader, "tokenizer.ggml.padding_token_id", None),
    }
    rope_theta = meta_float(reader, f"{arch}.rope.freq_base", 10000.0)
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    if spec.has_attention_bias_field:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if spec.fields is not None:
        kwargs.update(spec.fields(reader, arch, {**kwargs, "rope_theta": rope_theta}))
    return getattr(transformers, spec.config_class)(**kwargs)
