"""LoRA in the engine: a llama.cpp LoRA GGUF gives PEFT's output, the prefix cache never
crosses adapters, adapters beyond max_loras evict the least recently used, bad adapter files
are refused naming the file, and a GGUF base model kept as stored blocks runs an adapter."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from support.gguf_files import write_tiny_llama_gguf
from support.lora_adapters import random_lora, write_gguf_lora, write_peft_files

from minivllm import LoRARequest, SamplingParams
from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.lora import LoRABatch, LoRALinear
from minivllm.models.lora_files import load_lora

PROMPT = [1, 17, 42, 99, 7, 3, 250, 64, 12, 5, 77, 31, 8, 90, 45, 61, 22, 13]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# the tiny checkpoint's layers: name -> (in, out)
SHAPES = {
    "model.layers.0.self_attn.q_proj": (64, 64),
    "model.layers.0.self_attn.k_proj": (64, 32),
    "model.layers.0.self_attn.v_proj": (64, 32),
    "model.layers.0.self_attn.o_proj": (64, 64),
    "model.layers.1.self_attn.q_proj": (64, 64),
    "model.layers.1.self_attn.k_proj": (64, 32),
    "model.layers.1.mlp.gate_proj": (64, 128),
    "model.layers.1.mlp.up_proj": (64, 128),
    "model.layers.1.mlp.down_proj": (128, 64),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path):
    from minivllm import LLM

    return LLM(
        str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )


def _peft(tmp: Path, name: str, seed: int, r: int = 4) -> LoRARequest:
    return LoRARequest(
        name, seed, str(write_peft_files(tmp / name, random_lora(SHAPES, r, seed), r, 8))
    )


def _tokens(llm, lora: LoRARequest | None, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    return out.outputs[0].token_ids, out.num_cached_prompt_tokens


def test_gguf_lora_gives_the_peft_adapters_output(llm, tmp_path: Path) -> None:
    """A llama.cpp LoRA GGUF (q/k rows in rotary order, alpha in the metadata) written from the
    same A and B as a PEFT folder is read back to the same update: identical tokens."""
    modules = random_lora(SHAPES, 4, 11)
    peft = LoRARequest("p", 11, str(write_peft_files(tmp_path / "p", modules, 4, 8)))
    ggf = LoRARequest("g", 12, str(write_gguf_lora(tmp_path / "g.gguf", modules, 8, (4, 2))))
    outs = llm.generate([PROMPT] * 3, GREEDY, use_tqdm=False, lora_request=[peft, ggf, None])
    peft_out, gguf_out, base = (o.outputs[0].token_ids for o in outs)
    assert gguf_out == peft_out
    assert peft_out != base


def test_prefix_cache_never_crosses_adapters(llm, tmp_path: Path) -> None:
    """A block cached under one adapter is not reused by another (its KV differs) but is by the
    same adapter again."""
    a, b = _peft(tmp_path, "a", 21), _peft(tmp_path, "b", 22)
    first, _ = _tokens(llm, a)
    _, cached_b = _tokens(llm, b)
    again, cached_a = _tokens(llm, a)
    assert cached_b == 0
    assert cached_a == 16 and again == first


def test_loading_past_max_loras_evicts_the_least_recently_used(llm, tmp_path: Path) -> None:
    """With max_loras=2 a third adapter takes the slot of the one used longest ago."""
    manager = llm.llm_engine.model_runner.lora
    a, b, c = (_peft(tmp_path, n, s) for n, s in [("a", 31), ("b", 32), ("c", 33)])
    want_a, _ = _tokens(llm, a, PROMPT[:5])
    _tokens(llm, b, PROMPT[:5])
    _tokens(llm, a, PROMPT[:5])  # a is now the most recent
    _tokens(llm, c, PROMPT[:5])
    assert set(manager.slots) == {31, 33}
    assert _tokens(llm, a, PROMPT[:5])[0] == want_a  # reloaded into b's slot


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda d: write_peft_files(d, random_lora(SHAPES, 16, 1), 16, 8), "rank 16 is over"),
        (lambda d: _set_config(d, target_modules=["lm_head"]), "unknown target module"),
    ],
)
def test_bad_adapter_files_are_refused_naming_the_file(
    llm, tmp_path: Path, break_it, message: str
) -> None:
    """A broken adapter raises a ValueError that names its path and what is wrong."""
    req = _peft(tmp_path, "bad", 41)
    break_it(Path(req.lora_path))
    with pytest.raises(ValueError, match=message) as err:
        _tokens(llm, req)
    assert req.lora_path in str(err.value)


def _set_config(folder: Path, **changes: object) -> None:
    import json

    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_an_adapter_of_another_models_shape_is_refused(llm, tmp_path: Path) -> None:
    """A/B whose sizes do not fit the model's layer: ValueError naming the file and layer."""
    shapes = {"model.layers.0.self_attn.q_proj": (32, 64)}
    path = write_peft_files(tmp_path / "wide", random_lora(shapes, 4, 1), 4, 8)
    with pytest.raises(ValueError, match=r"wide.*q_proj.*takes 64 inputs"):
        _tokens(llm, LoRARequest("wide", 51, str(path)))


def test_load_lora_refuses_a_missing_path(tmp_path: Path) -> None:
    """A path that does not exist is named in the error."""
    with pytest.raises(ValueError, match="no such file"):
        load_lora(tmp_path / "nope", 8)


def test_the_update_is_the_same_when_the_mlp_runs_rows_in_slices() -> None:
    """The MLP may run a long prefill a slice of rows at a time: each slice's rows get their
    own adapter (the layer's cursor), as in one call."""
    batch = LoRABatch(max_loras=2)
    hook = LoRALinear(batch, [8], key=0)
    gen = torch.Generator().manual_seed(0)
    hook.install(0, [(torch.randn(2, 4, generator=gen), torch.randn(8, 2, generator=gen))])
    hook.install(1, [(torch.randn(3, 4, generator=gen), torch.randn(8, 3, generator=gen))])
    batch.set_rows([0, -1, 1, 1, 0, -1, -1, 1], torch.device("cpu"))
    x, base = torch.randn(8, 4, generator=gen), torch.randn(8, 8, generator=gen)
    whole = hook(x, base)
    sliced = torch.cat([hook(x[i : i + 3], base[i : i + 3]) for i in range(0, 8, 3)])
    torch.testing.assert_close(sliced, whole)
    assert torch.equal(whole[[1, 5, 6]], base[[1, 5, 6]])  # base rows untouched


@pytest.mark.skipif(not cpu_kernels_available(), reason="the block kernels are not built")
def test_a_gguf_base_kept_as_stored_blocks_runs_an_adapter(tmp_path: Path) -> None:
    """A GGUF whose MLP down projections stay Q6_K blocks (the default dtype: fp32 is the
    all-dense token-exact path): an adapter on them and on q runs on top of the blocks and
    changes the output. Not compared token for token: the block kernels' rounding differs."""
    from minivllm import LLM

    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", ffn_type=gguf.GGMLQuantizationType.Q6_K)
    shapes = {
        "model.layers.0.self_attn.q_proj": (64, 64),
        "model.layers.1.mlp.down_proj": (256, 64),
    }
    req = LoRARequest(
        "g", 1, str(write_peft_files(tmp_path / "a", random_lora(shapes, 4, 3), 4, 8))
    )
    llm = LLM(str(model), device="cpu", enable_lora=True, num_kv_blocks=32)
    runner = llm.llm_engine.model_runner
    assert "model.layers.1.mlp.down_proj.weight" in runner.block_weights
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    outs = llm.generate([PROMPT[:10]] * 2, params, use_tqdm=False, lora_request=[req, None])
    with_adapter, base = (
        {t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs
    )
    assert with_adapter != base  # the tiny file's greedy tokens are all 0: its log-probs move


@pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_equals_the_masked_matmuls(dtype: torch.dtype) -> None:
    """Small steps run our grouped kernel (each row through its own adapter), larger ones the
    masked matmuls over every adapter: the same update, base rows untouched, whole or in
    slices, with ranks that differ between adapters and a slot this layer has no adapter in."""
    batch = LoRABatch(max_loras=3)
    hook = LoRALinear(batch, [40, 24], key=0)
    gen = torch.Generator().manual_seed(1)

    def shard(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(rank, 36, generator=gen).to(dtype)
        return a, torch.randn(rows, rank, generator=gen).to(dtype)

    hook.install(0, [shard(2, 40), None])
    hook.install(2, [shard(5, 40), shard(3, 24)])
    slots = [0, -1, 2, 1, 2, 0, -1, 2, 0, 2, 1]  # slot 1: an adapter that skips this layer
    batch.set_rows(slots, torch.device("cpu"))
    x, base = torch.randn(11, 36, generator=gen).to(dtype), torch.randn(11, 64, generator=gen)
    base = base.to(dtype)
    assert hook.kernel_a is not None and hook.kernel_rows >= 11
    grouped = hook(x, base)
    sliced = torch.cat([hook(x[i : i + 4], base[i : i + 4]) for i in range(0, 11, 4)])
    hook.kernel_rows = 0
    masked = hook(x, base)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(grouped, masked, **tol)
    torch.testing.assert_close(sliced, grouped)
    for row, slot in enumerate(slots):
        if slot in (-1, 1):
            assert torch.equal(grouped[row], base[row]) and torch.equal(masked[row], base[row])
