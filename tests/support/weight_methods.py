"""Give a layer its method through the chooser, as the loader does, for the kernel tests."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.quantization.chooser import Method, StoredFormat, choose_method
from minivllm.layers.quantization.kernels.int4 import Int4Weight, split_int8
from minivllm.layers.quantization.policy import WeightPolicy

# The policy of a model whose 4-bit weights run as stored (the kernel's name is only logged:
# the chooser picks by the layer's dtype and the CPU)
STORED_4BIT = WeightPolicy(
    keep_blocks=False, stored_kernel="int4", int8=False, quantize_int4=False, token_exact=False
)


def give_int4(layer: nn.Module, weight: Int4Weight) -> Method:
    """The chooser's method for `layer` whose checkpoint holds `weight` in 4 bits."""
    return choose_method(layer, StoredFormat(int4=weight), STORED_4BIT)


def give_q8_0_head(head: nn.Module, codes: torch.Tensor, scales: torch.Tensor) -> Method:
    """The chooser's method for an LM head whose checkpoint holds a Q8_0 weight."""
    return choose_method(head, StoredFormat(int8_halves=split_int8(codes, scales)), STORED_4BIT)
