"""Our Triton paged-attention kernel, run on the CPU under Triton's interpreter, against the
SDPA backend on the same paged cache.

Guards: a block-table lookup off by a block, cached context (prefix cache, earlier chunks)
not seen or new tokens seen acausally, a split of a long context's keys lost or counted twice
in the reduction, verify steps (several queries a sequence) masked as decodes, GQA rows
mapped to the wrong KV head, a window or soft-cap applied off by one or after the mask, and a
head size that is not a power of two reading past its row. The cases run in one process of
their own with `TRITON_INTERPRET=1` (`support/triton_cases.py` says why), on tiny shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.model_fixtures import make_attention_metadata

from minivllm.layers.attention import triton_attention as host

# name -> `support.triton_cases.compare` keyword arguments
CASES: dict[str, dict[str, Any]] = {
    "prefill_with_context": {"context_lens": [20, 0], "query_lens": [7, 5]},
    "chunked_prefill_gqa": {"context_lens": [33, 9, 40], "query_lens": [18, 1, 1], "heads": [4, 2]},
    "decode_split": {
        "context_lens": [150, 40],
        "query_lens": [1, 1],
        "heads": [4, 1],
        "num_splits": 4,
    },
    "decode_default_split": {"context_lens": [600], "query_lens": [1], "heads": [2, 1]},
    "verify_split": {"context_lens": [90, 13], "query_lens": [4, 4], "num_splits": 2},
    "window_softcap": {"context_lens": [30, 50], "query_lens": [6, 1], "window": 9, "softcap": 5.0},
    "window_softcap_split": {
        "context_lens": [170],
        "query_lens": [1],
        "window": 100,
        "softcap": 5.0,
        "num_splits": 2,
    },
    "head_dim_64": {"context_lens": [17], "query_lens": [3], "head_dim": 64, "block_size": 8},
    "head_dim_80": {"context_lens": [17], "query_lens": [3], "head_dim": 80, "block_size": 8},
    "head_dim_256": {"context_lens": [17], "query_lens": [3], "head_dim": 256, "block_size": 8},
    "int8_decode_split": {
        "context_lens": [150, 40],
        "query_lens": [1, 1],
        "num_splits": 4,
        "kv_cache_dtype": "int8",
    },
    "fp8_verify_window_softcap": {
        "context_lens": [90, 13],
        "query_lens": [4, 4],
        "window": 40,
        "softcap": 5.0,
        "num_splits": 2,
        "kv_cache_dtype": "fp8",
    },
}
# The chunked prefill beside decodes over each quantized cache, read as stored.
for _kind in ("int8", "fp8"):
    CASES[f"{_kind}_chunked_gqa"] = {**CASES["chunked_prefill_gqa"], "kv_cache_dtype": _kind}


def model_cases(model_dir: Path) -> dict[str, dict[str, str]]:
    """`support.triton_cases.model_steps` over each cache the kernel reads."""
    return {
        f"model_steps_{kind}": {"model_dir": str(model_dir), "kv_cache_dtype": kind}
        for kind in ("auto", "int8", "fp8")
    }


@pytest.fixture(scope="module")
def results(tiny_llama_dir: Path) -> dict[str, str | None]:
    """Every case, and a tiny model's steps, run once in an interpreted process."""
    pytest.importorskip("triton", reason="triton is not installed: the kernel cannot run")
    tests = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "support.triton_cases",
            json.dumps({**CASES, **model_cases(tiny_llama_dir)}),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_prefill_over_cached_context_and_a_fresh_prompt(results: dict) -> None:
    """A prefix-cache hit (context 20, 7 new tokens, crossing blocks) beside a prompt with
    nothing cached: every new token sees the context and the new tokens up to itself."""
    assert results["prefill_with_context"] is None


def test_chunked_prefill_beside_decodes_gqa(results: dict) -> None:
    """A later chunk of a long prompt in the same step as two decodes, 4 query heads on 2 KV
    heads: each query row reads its own KV head, prefills tile several tokens a program."""
    assert results["chunked_prefill_gqa"] is None


def test_decode_long_context_split_across_programs(results: dict) -> None:
    """One query a sequence over contexts of several key tiles, the keys split across 4
    programs (some empty for the shorter sequence) and reduced; and a small long decode
    split by the default heuristic."""
    assert results["decode_split"] is None
    assert results["decode_default_split"] is None


def test_verify_step_split(results: dict) -> None:
    """Speculative decoding's verify step: 4 queries a sequence, causal among themselves,
    over a split context (MQA: 2 heads on one KV head)."""
    assert results["verify_split"] is None


def test_sliding_window_and_soft_cap(results: dict) -> None:
    """A window shorter than the context (prefill and decode rows), and scores soft-capped
    before the mask, in whole and split forms."""
    assert results["window_softcap"] is None
    assert results["window_softcap_split"] is None


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_head_sizes(results: dict, head_dim: int) -> None:
    """Power-of-two head sizes to the largest the backend takes, and 80 (padded to 128 in the
    kernel, the pad masked)."""
    assert results[f"head_dim_{head_dim}"] is None


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_a_models_steps_on_the_triton_backend(results: dict, kind: str) -> None:
    """A tiny Llama's chunked prefills and decodes with every layer on the Triton backend
    give SDPA's hidden states: the backend as the layers call it, over a cache as computed,
    int8 (its scales, the layers' turn of queries and keys) or fp8."""
    assert results[f"model_steps_{kind}"] is None


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_cache_read_as_stored(results: dict, kind: str) -> None:
    """int8 codes with their scales (the key's on the scores, the value's on the tile) and
    fp8 bytes widened in the kernel, against SDPA over the same cache: chunked prefill with
    GQA, and a split decode (int8) or a split verify step with window and soft-cap (fp8)."""
    assert results[f"{kind}_chunked_gqa"] is None
    other = "int8_decode_split" if kind == "int8" else "fp8_verify_window_softcap"
    assert results[other] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_case_compiled_on_cuda(dtype: torch.dtype) -> None:
    """The same cases through the compiled kernel on a GPU, in the model's bf16 (the tiles of
    `tl.dot` as the hardware runs them) and in fp32 (IEEE dots: the token-exact path)."""
    pytest.importorskip("triton")
    from support.triton_cases import compare

    for name, case in CASES.items():
        heads = tuple(case.get("heads", (2, 1)))
        try:
            compare(**{**case, "heads": heads}, device="cuda", dtype=dtype)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


def test_decode_splits_by_default_only_for_long_small_batches() -> None:
    """Keys are split when a decode step launches few programs over long contexts, never into
    shares under MIN_KEYS_PER_SPLIT keys, and always a power of two."""
    assert host.num_kv_splits(1 * 8, 100) == 1
    assert host.num_kv_splits(256 * 8, 4096) == 1
    assert host.num_kv_splits(1 * 8, 4096) == 16
    assert host.num_kv_splits(1 * 2, 100_000) == host.MAX_SPLITS
    assert host.num_kv_splits(3, 3 * host.MIN_KEYS_PER_SPLIT) == 2


def test_tile_sizes_fit_tl_dot_and_the_group() -> None:
    """A tile's rows hold its tokens' whole query-head group and are at least 16 (`tl.dot`)."""
    assert host.tile_sizes(1, 4) == (1, 16)
    assert host.tile_sizes(1, 32) == (1, 32)
    assert host.tile_sizes(5, 2) == (8, 16)
    assert host.tile_sizes(500, 4) == (16, 64)
    assert host.tile_sizes(500, 128) == (1, 128)


def test_backend_is_chosen_on_cuda_only_and_refuses_a_cache_it_cannot_read() -> None:
    """Chosen only on CUDA with triton, for caches as computed, int8 or fp8, up to head size
    256; an int8 cache without its scales (or another integer cache) is a clear error, not a
    wrong answer."""
    cuda = torch.device("cuda")
    assert host.triton_attention_supported(cuda, torch.bfloat16, 128, available=True)
    assert host.triton_attention_supported(cuda, torch.int8, 128, available=True)
    assert host.triton_attention_supported(cuda, host.FP8, 128, available=True)
    assert not host.triton_attention_supported(cuda, torch.bfloat16, 128, available=False)
    assert not host.triton_attention_supported(cuda, torch.bfloat16, 512, available=True)
    assert not host.triton_attention_supported(torch.device("cpu"), torch.float32, 64, True)
    meta, _ = make_attention_metadata([[0]], [0], [1], 4)
    q = torch.zeros(1, 1, 8)
    cache = torch.zeros(1, 4, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs scales with an int8 cache only"):
        host.paged_attention_triton(q, cache, cache, meta, 1.0)
    with pytest.raises(ValueError, match="cannot read a torch.int16 KV cache"):
        host.paged_attention_triton(q, cache.short(), cache.short(), meta, 1.0)
