"""The weight policy: how the weights of one engine run, decided once before any is loaded.

`WeightPolicy.decide` reads the engine's options, the device and dtype, the number of
processes, whether the checkpoint is a GGUF, and the CPU's capabilities (`cpu_caps()`), and
answers three questions that `minivllm.layers.quantization.chooser` then applies per layer:

- `keep_blocks`: do a GGUF's quantized tensors (`BLOCK_TYPES`: Q4_0 ... Q6_K) stay as stored
  blocks?
- `stored_kernel`: which kernel runs the 4-bit weights not kept as blocks, and a Q8_0 LM
  head: "int4" (torch's int4, bf16 on the CPU), "qgemv" (ours, fp32 on x86 with AVX2) or None
  (dense)?
- `int8`: `quantization="int8"` (`Int8Method` on `INT8_LAYERS`)?

`TOKEN_EXACT` is the one named policy of the fp32 path held token-exact to HF transformers
(float32 asked for explicitly with the default quantization): every weight dense (no blocks,
no qgemv) and its decode step eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.config import EngineConfig
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.quantization.int8 import check_quantization
from minivllm.layers.quantization.kernels.block_weight import BlockSegment, two_code_block
from minivllm.layers.quantization.kernels.int4 import int4_supported


@dataclass(frozen=True)
class WeightPolicy:
    """How the weights run, decided once at load (see the module docstring)."""

    keep_blocks: bool
    stored_kernel: str | None  # "int4", "qgemv" or None
    int8: bool
    quantize_int4: bool  # quantization="int4": the layers with no 4-bit tensor get one at load
    token_exact: bool

    @staticmethod
    def decide(
        config: EngineConfig, device: torch.device, dtype: torch.dtype, tp_size: int, gguf: bool
    ) -> WeightPolicy:
        """The policy for these options on this machine; ValueError for a quantization that
        cannot run here."""
        method = config.quantization
        if method is None and config.dtype not in (None, "auto") and dtype == torch.float32:
            return TOKEN_EXACT
        alone_on_cpu = device.type == "cpu" and tp_size == 1
        keep_blocks = gguf and alone_on_cpu and method is None and cpu_caps().kernels
        if method == "int8":
            check_quantization(method, device, dtype)
        kernel = None
        if method not in ("int8", "none") and (method == "int4" or tp_size == 1):
            kernel = stored_weight_kernel(device, dtype)
            if method == "int4" and (kernel is None or tp_size > 1):
                raise ValueError(
                    "quantization='int4' runs on the CPU (bfloat16, or float32 on "
                    "an x86 CPU with AVX2) with tensor_parallel_size=1 (got "
                    f"device {device.type}, dtype {dtype}, "
                    f"tensor_parallel_size {tp_size})"
                )
        return WeightPolicy(
            keep_blocks=keep_blocks,
            stored_kernel=kernel,
            int8=method == "int8",
            quantize_int4=method == "int4",
            token_exact=False,
        )


# fp32 asked for explicitly with the default quantization: HF transformers' tokens, exactly.
TOKEN_EXACT = WeightPolicy(
    keep_blocks=False, stored_kernel=None, int8=False, quantize_int4=False, token_exact=True
)


def stored_weight_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The kernel for 4-bit weights kept as stored on `device` computing in `dtype`: torch's
    int4 where the model computes in bf16 on the CPU, our qgemv in fp32 on an x86 CPU with
    AVX2 (where the kernels loaded), else None (dense)."""
    if int4_supported(device, dtype):
        return "int4"
    if device.type == "cpu" and dtype == torch.float32 and cpu_caps().kernels:
        return "qgemv"
    return None


# The activation precision of the stored-block kernels (`BlockWeight`'s `activations`), per
# block over which the integer kernel rounds them: 256 inputs for the K kinds (Q4_K, Q5_K,
# Q6_K), 32 for Q5_0/Q5_1/Q8_0. A block holding one of the huge activations of a model such
# as Gemma 3 gets a step that rounds its other inputs to 0; a second 8-bit code for the
# residual brings them back, at the same weight reads (docs/ggml-kernels.md, "Activation
# precision", measured on real files). The LM head takes one code whatever its blocks
# (`chooser._head_method`: its top logits are refined in fp32).
BLOCK_ACTIVATIONS = {256: "int8x2", 32: "int8x2"}

# The layers whose inputs leave a norm (the attention's q/k/v and the MLP's gate and up
# projections) take one code on K-kind blocks, as llama.cpp's Q8_K; o_proj and down_proj,
# fed by the attention's values and the MLP's gated product, keep BLOCK_ACTIVATIONS. Measured
# on real files against HF fp32 (docs/ggml-kernels.md, "One code where the inputs leave a
# norm"): one code on Gemma-3-270M's o_proj and down_proj (its only K-kind layers) misses
# the quality bar; on the coder's normed layers it holds it with room. A second code doubles
# the integer rows of a step, so where the step is compute-bound (prefills, many sequences,
# drafts) these layers, most of a layer's weights, run in half the time.
NORMED_INPUT_LAYERS = frozenset({"qkv_proj", "gate_up_proj"})
NORMED_BLOCK_ACTIVATIONS = {256: "int8", 32: "int8x2"}


def block_activations(segments: list[BlockSegment], layer: str = "") -> str:
    """The activation precision for the stored-block weight of `segments` of the layer named
    `layer` (its module path; NORMED_BLOCK_ACTIVATIONS for NORMED_INPUT_LAYERS, else
    BLOCK_ACTIVATIONS; "int8" where its kinds round over different blocks)."""
    block = two_code_block(segments)
    if block is None:
        return "int8"
    normed = layer.rsplit(".", 1)[-1] in NORMED_INPUT_LAYERS
    return (NORMED_BLOCK_ACTIVATIONS if normed else BLOCK_ACTIVATIONS)[block]
