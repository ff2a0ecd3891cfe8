"""oneDNN-prepacked bf16 weights (minivllm/layers/quantization/kernels/onednn.py): the same
results as F.linear, bit for bit, at every row count; only bf16 CPU weights are packed; the runner
packs the dense layers and the LM head of a bf16 model and none of an fp32 one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.layers.embedding import ParallelLMHead
from minivllm.layers.linear import ReplicatedLinear
from minivllm.layers.quantization.head import DenseHead
from minivllm.layers.quantization.kernels.onednn import OneDnnWeight, onednn_prepack_supported

pytestmark = pytest.mark.skipif(
    not onednn_prepack_supported(torch.zeros(1, dtype=torch.bfloat16)),
    reason="no oneDNN bf16 kernels on this CPU (AVX2 only) or in this torch build",
)


@pytest.mark.parametrize("rows", [1, 3, 16, 37, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_matmul_equals_f_linear_bit_for_bit(rows, bias) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    x = torch.randn(rows, 64).bfloat16()
    got = OneDnnWeight(weight).matmul(x, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert torch.equal(got, F.linear(x, weight, b))


def test_a_linear_layer_uses_its_prepacked_weight_and_keeps_its_answers() -> None:
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 48, bias=True)
    layer.weight.data = torch.randn(48, 64).bfloat16()
    layer.bias.data = torch.randn(48).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    before = layer(x)
    layer.method.process_weights_after_loading(layer)
    assert layer.method.onednn is not None
    assert torch.equal(layer(x), before)


def test_only_bf16_cpu_weights_are_prepacked() -> None:
    layer = ReplicatedLinear(64, 48, bias=False)  # fp32: the token-exact path keeps MKL
    layer.method.process_weights_after_loading(layer)
    assert layer.method.onednn is None
    with pytest.raises(ValueError, match="bf16"):
        OneDnnWeight(torch.zeros(4, 4))


def test_the_bf16_lm_head_prepacked_gives_the_same_logits() -> None:
    torch.manual_seed(1)
    head = ParallelLMHead(300, 64)
    head.weight.data = torch.randn(300, 64).bfloat16()
    hidden = torch.randn(7, 64).bfloat16()
    before = head(hidden)
    head.method.process_weights_after_loading(head)
    assert isinstance(head.method, DenseHead) and isinstance(head.method.packed, OneDnnWeight)
    after = head(hidden)
    assert after.dtype == torch.float32 and torch.equal(after, before)


def test_a_q8_0_heads_top_logits_are_refined_to_fp32() -> None:
    """A bf16 head over a Q8_0 file's rows: each row's REFINED_LOGITS highest logits are the
    fp32 product with the exact weight (the rest stay bf16 ones), so the greedy token is
    fp32's; without the exact rows they are not."""
    from gguf import GGMLQuantizationType, dequantize, quantize

    from minivllm.layers.quantization.head import REFINED_LOGITS
    from minivllm.layers.quantization.kernels.block_weight import BlockSegment
    from minivllm.layers.top_rows import topk_rows

    torch.manual_seed(2)
    q8_0 = GGMLQuantizationType.Q8_0
    blocks = quantize((torch.randn(4000, 64) * 0.5).numpy(), q8_0)  # [4000, 68] uint8
    exact = torch.from_numpy(dequantize(blocks, q8_0))  # [4000, 64] fp32
    hidden = (torch.randn(9, 64) * 4).bfloat16()
    reference = F.linear(hidden.float(), exact)  # [9, 4000]

    head = ParallelLMHead(4000, 64)
    head.weight.data = exact.bfloat16()
    head.method.process_weights_after_loading(head)
    rounded = head(hidden)
    exact_head = DenseHead(exact_rows=BlockSegment(torch.from_numpy(blocks), q8_0))
    exact_head.process_weights_after_loading(head)
    head.set_method(exact_head)
    refined = head(hidden)

    # the REFINED_LOGITS highest (bf16 logits tie often: which of the tied ones at the edge
    # is the head's choice, and topk_rows gives torch's values)
    values, top = topk_rows(rounded, REFINED_LOGITS)
    assert torch.equal(values, rounded.topk(REFINED_LOGITS, dim=-1).values)
    torch.testing.assert_close(refined.gather(1, top), reference.gather(1, top))
    rest = torch.ones_like(refined, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(refined[rest], rounded[rest])
    assert torch.equal(refined.argmax(-1), reference.argmax(-1))
    assert (rounded.gather(1, top) - reference.gather(1, top)).abs().max() > 1e-3


@pytest.mark.parametrize("dtype, packed", [("bfloat16", True), ("float32", False)])
def test_the_runner_prepacks_the_dense_layers_of_a_bf16_model(dtype, packed, tiny_llama_dir):
    from minivllm import LLM
    from minivllm.layers.linear import LinearBase

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, dtype=dtype, enforce_eager=True)
    layers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all((m.method.onednn is not None) == packed for m in layers)
