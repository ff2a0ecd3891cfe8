"""minivllm: a small, fast, readable LLM inference engine."""

from minivllm.logprobs import Logprob
from minivllm.lora_request import LoRARequest
from minivllm.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "LoRARequest",
]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for, so the engine core stays light.
    if name == "LLM":
        from minivllm.llm import LLM

        return LLM
    raise AttributeError(name)
