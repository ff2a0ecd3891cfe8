"""A linear layer's method (minivllm/layers/quantization/methods.py): `forward` is
`method.apply(layer, x, bias)`; a new layer is dense; stored GGUF blocks drop the dense weight,
refuse a weight of another shape or a split layer, and add the bias; int8 weights compute as
`int8_linear` does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from minivllm.layers.linear import ReplicatedLinear, RowParallelLinear
from minivllm.layers.quantization.int8 import int8_linear, pack_int8
from minivllm.layers.quantization.kernels.block_weight import BlockSegment, BlockWeight
from minivllm.layers.quantization.methods import GgmlBlockMethod, Int8Method, UnquantizedMethod


def _blocks(weight: torch.Tensor) -> BlockWeight:
    """`weight` `[out, in]` as Q8_0 blocks."""
    rows = quantize(weight.numpy().astype(np.float32), GGMLQuantizationType.Q8_0)
    return BlockWeight(
        [BlockSegment(torch.from_numpy(rows), GGMLQuantizationType.Q8_0)], weight.shape[1]
    )


def test_a_new_layer_is_dense_and_forward_is_its_methods_apply() -> None:
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(3, 64)
    assert isinstance(layer.method, UnquantizedMethod)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x), layer.method.apply(layer, x, layer.bias))
    assert "method=dense" in repr(layer)


@pytest.mark.parametrize("rows", [1, 40])
def test_stored_blocks_replace_the_dense_weight_and_add_the_bias(rows: int) -> None:
    """One row (integer dots) and 40 (tile-by-tile dequantization): BlockWeight's answer."""
    torch.manual_seed(rows)
    weight = torch.randn(32, 64)
    layer = ReplicatedLinear(64, 32, bias=True)
    layer.bias.data.normal_()
    blocks = _blocks(weight)
    layer.set_method(GgmlBlockMethod(blocks))
    assert layer.weight.shape == (0, 64)
    x = torch.randn(rows, 64)
    assert torch.equal(layer(x), blocks.matmul(x) + layer.bias)


def test_stored_blocks_of_another_shape_or_for_a_split_layer_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        ReplicatedLinear(64, 16).set_method(GgmlBlockMethod(_blocks(torch.randn(32, 64))))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        RowParallelLinear(64, 32, tp_size=2, tp_rank=0).set_method(
            GgmlBlockMethod(_blocks(torch.randn(32, 32)))
        )


def test_int8_weights_compute_as_int8_linear() -> None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm in this torch build")
    torch.manual_seed(1)
    layer = ReplicatedLinear(64, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.set_method(Int8Method())
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(4, 64)
    want = int8_linear(x, pack_int8(layer.weight)) + layer.bias
    assert torch.equal(layer(x), want)
