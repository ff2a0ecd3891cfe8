"""GGUF 4-bit blocks read straight into int4 weights: the codes, scales and zeros must give
exactly the weights the dense converter dequantizes (same values, same un-permuted rows)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from minivllm.models import gguf as mgguf
from minivllm.models.gguf_file import GGUFFile
from minivllm.models.gguf_int4 import int4_from_tensor, read_int4_weights


def _random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks `[rows, bytes per row]`: any code bytes, finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    halves = 2 if qtype in (QT.Q4_1, QT.Q4_K) else 1  # d, and m / dmin
    for h in range(halves):
        scales = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
        blocks[:, 2 * h : 2 * h + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, QT]], arch: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda q: q.name)
def test_int4_blocks_equal_the_dense_dequantization(tmp_path: Path, qtype: QT):
    """Q4_0 / Q4_1 / Q4_K as (q - 8) * scale + zero: the same weights as gguf-py's decoder
    (itself checked against ggml's C loops in test_gguf.py), up to float rounding."""
    rows, cols = 8, 512
    _write(
        tmp_path / "t.gguf",
        {"t.weight": (_random_blocks(qtype, rows, cols, np.random.default_rng(0)), qtype)},
    )
    (tensor,) = GGUFFile(tmp_path / "t.gguf").tensors
    weight = int4_from_tensor(tensor)
    assert weight.codes.shape == (rows, cols) and int(weight.codes.max()) <= 15
    dense = torch.from_numpy(mgguf.dequantize_tensor(tensor))
    torch.testing.assert_close(weight.dequantize(), dense, rtol=1e-5, atol=1e-6)


def test_read_int4_weights_unpermutes_llama_qk_like_the_converter(tmp_path: Path):
    """q/k rows come out in HF order (llama.cpp permutes them for llama), other tensors
    unchanged, and tensors that are not 4-bit are left to the dense loader."""
    rng = np.random.default_rng(1)
    tensors = {
        "blk.0.attn_q.weight": (_random_blocks(QT.Q4_1, 64, 64, rng), QT.Q4_1),  # 4 heads
        "blk.0.attn_k.weight": (_random_blocks(QT.Q4_0, 32, 64, rng), QT.Q4_0),  # 2 KV heads
        "blk.0.ffn_up.weight": (_random_blocks(QT.Q4_K, 4, 256, rng), QT.Q4_K),
        "blk.0.ffn_down.weight": (_random_blocks(QT.Q8_0, 4, 64, rng), QT.Q8_0),
    }
    path = tmp_path / "m.gguf"
    _write(path, tensors)
    dense = mgguf.read_state_dict(GGUFFile(path))
    int4 = read_int4_weights(GGUFFile(path))
    assert set(int4) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    }  # no LM head in this file
    for name, weight in int4.items():
        torch.testing.assert_close(weight.dequantize(), dense[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("head", ["output.weight", "token_embd.weight"])
def test_a_q8_0_lm_head_is_read_as_two_int4_halves_of_the_same_weight(tmp_path: Path, head):
    """The LM head (its own `output`, or the tied embedding) in Q8_0: the halves' sum is the
    weight the dense converter dequantizes."""
    from minivllm.models.gguf_int4 import LM_HEAD_HIGH, LM_HEAD_LOW

    rng = np.random.default_rng(5)
    path = tmp_path / "m.gguf"
    _write(path, {head: (_random_blocks(QT.Q8_0, 16, 64, rng), QT.Q8_0)})
    (tensor,) = GGUFFile(path).tensors
    weights = read_int4_weights(GGUFFile(path))
    assert set(weights) == {LM_HEAD_HIGH, LM_HEAD_LOW}
    dense = torch.from_numpy(mgguf.dequantize_tensor(tensor))
    total = weights[LM_HEAD_HIGH].dequantize() + weights[LM_HEAD_LOW].dequantize()
    torch.testing.assert_close(total, dense, rtol=1e-5, atol=1e-6)
