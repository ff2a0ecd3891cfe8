"""Which model class serves which HF architecture name (`config.architectures`)."""

from typing import Any

from torch import nn

from minivllm.models.gemma2 import Gemma2ForCausalLM
from minivllm.models.gemma3 import Gemma3ForCausalLM
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.mistral import MistralForCausalLM
from minivllm.models.phi3 import Phi3ForCausalLM
from minivllm.models.qwen2 import Qwen2ForCausalLM
from minivllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names this engine can run."""
    return sorted(MODEL_REGISTRY)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for the first supported name in `hf_config.architectures`.

    Raises `ValueError` naming the checkpoint's architectures and the supported ones otherwise.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    found = ", ".join(architectures) if architectures else "none listed in config.json"
    raise ValueError(
        f"unsupported model architecture ({found}); "
        f"supported: {', '.join(supported_architectures())}"
    )
