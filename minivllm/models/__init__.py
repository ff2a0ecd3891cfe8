"""Model definitions, the architecture registry and the safetensors loader."""

from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import load_model
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.models.registry import get_model_class, supported_architectures

__all__ = [
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "load_model",
    "supported_architectures",
]
