"""Model definitions, the architecture registry and the safetensors loader."""

from minivllm.models.gemma2 import Gemma2ForCausalLM
from minivllm.models.gemma3 import Gemma3ForCausalLM
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import load_model
from minivllm.models.mistral import MistralForCausalLM
from minivllm.models.phi3 import Phi3ForCausalLM
from minivllm.models.qwen2 import Qwen2ForCausalLM
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.models.registry import get_model_class, supported_architectures

__all__ = [
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "load_model",
    "supported_architectures",
]
