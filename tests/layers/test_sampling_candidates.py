"""Sampling among each row's largest logits (`minivllm.layers.sampling_candidates`) against the
whole-vocabulary rules (`sampler.whole_vocabulary`): the same distribution within float
rounding and, for the same uniforms, the same tokens; None wherever a row's rules could keep a
token beyond the candidates."""

from __future__ import annotations

import pytest
import torch

from minivllm.layers.sampler import sample_from, whole_vocabulary
from minivllm.layers.sampling_candidates import (
    CANDIDATES,
    WIDE_CANDIDATES,
    candidates,
    invert_cdf,
    sample_among,
)
from minivllm.sampling_params import SamplingParams

VOCAB = 5000


def _logits(
    rows: int, scale: float, seed: int = 0, bf16: bool = True, vocab: int = VOCAB
) -> torch.Tensor:
    """`[rows, vocab]` logits, rounded to bf16 as a bf16 model's head gives them (many ties),
    or left in fp32 (none)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    return logits.bfloat16().float() if bf16 else logits


CASES = {
    "top_k": [SamplingParams(temperature=0.7, top_k=k) for k in (1, 5, 40, 64)],
    "top_p": [SamplingParams(temperature=0.8, top_p=p) for p in (0.5, 0.9, 0.95, 0.99)],
    "min_p": [SamplingParams(temperature=1.0, min_p=p) for p in (0.05, 0.1, 0.2, 0.5)],
    "all three": [SamplingParams(temperature=0.6, top_k=64, top_p=0.95, min_p=0.05)] * 4,
    "greedy beside": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    + [SamplingParams(temperature=0.9, top_k=20, top_p=0.8)] * 2,
}


def _both(params: list[SamplingParams], logits: torch.Tensor) -> tuple:
    """(candidates' values and ids, their distribution scattered to `[N, V]`, the
    whole-vocabulary one, which rows sample)."""
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    scaled = logits / temperature.unsqueeze(-1)
    found = candidates(scaled, params)
    assert found is not None
    values, ids = found
    got = torch.zeros_like(scaled).scatter_(-1, ids, values.softmax(dim=-1))
    sampling = torch.tensor([not p.greedy for p in params])
    return values, ids, got[sampling], whole_vocabulary(scaled, params)[sampling], sampling


@pytest.mark.parametrize("case", CASES, ids=str)
def test_candidates_give_the_whole_vocabularys_distribution(case: str) -> None:
    """bf16 logits (ties): the same probabilities, up to which of two tied tokens a nucleus
    edge keeps (the whole-vocabulary sort leaves that order unspecified too)."""
    params = CASES[case]
    _, _, got, want, _ = _both(params, _logits(len(params), scale=4.0, seed=len(case)))
    torch.testing.assert_close(got.sort(-1).values, want.sort(-1).values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_same_uniform_picks_the_same_token(case: str) -> None:
    """fp32 logits (no ties): for the same uniforms, the same tokens and probabilities."""
    params = CASES[case]
    values, ids, got, want, sampling = _both(params, _logits(len(params), 4.0, 7, bf16=False))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = torch.zeros(len(params), VOCAB)
    full[sampling] = want
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(len(params), dtype=torch.float64, generator=g)
        picked = sample_among(values, ids, u)
        assert torch.equal(picked[sampling], sample_from(full, u)[sampling])


def test_ties_at_the_top_k_edge_are_kept_as_the_whole_vocabulary_keeps_them() -> None:
    """A k-th logit shared by several tokens keeps all of them, as `apply_top_k` does."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, :3] = torch.tensor([3.0, 2.0, 1.0])
    logits[0, 10:20] = 1.0  # ten more tokens tied with the third largest
    params = [SamplingParams(temperature=1.0, top_k=3)]
    values, ids = candidates(logits, params)
    kept = ids[values > float("-inf")]
    assert set(kept.tolist()) == {0, 1, 2, *range(10, 20)}


@pytest.mark.parametrize(
    ("params", "scale"),
    [
        ([SamplingParams(temperature=1.0)], 4.0),  # no truncation: every token may come
        ([SamplingParams(temperature=1.0, top_k=WIDE_CANDIDATES + 1)], 4.0),
        ([SamplingParams(temperature=1.0, top_p=0.95)], 0.1),  # a flat row: a wide nucleus
        ([SamplingParams(temperature=1.0, min_p=0.5)], 0.0),  # every token at the top's level
        ([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], 4.0),
    ],
    ids=["none", "large k", "flat nucleus", "flat min-p", "greedy beside none"],
)
def test_rules_that_may_reach_past_the_candidates_take_the_whole_vocabulary(
    params: list[SamplingParams], scale: float
) -> None:
    logits = _logits(len(params), scale, vocab=4 * WIDE_CANDIDATES)
    assert candidates(logits, params) is None


def test_a_wide_nucleus_takes_the_wider_candidates() -> None:
    """A nucleus of a few thousand tokens (beyond the first 1024 candidates) is found among the
    wider ones, with the whole vocabulary's distribution."""
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 2
    logits = _logits(2, 2.5, seed=3, bf16=False, vocab=4 * WIDE_CANDIDATES)  # about 3.5k
    values, ids = candidates(logits, params)
    assert CANDIDATES < values.shape[-1] <= WIDE_CANDIDATES
    kept = int((values > float("-inf")).sum(-1).max())
    assert kept > CANDIDATES
    got = torch.zeros_like(logits).scatter_(-1, ids, values.softmax(dim=-1))
    torch.testing.assert_close(got, whole_vocabulary(logits, params), rtol=1e-4, atol=1e-7)


def test_greedy_rows_alone_never_block_the_fast_path() -> None:
    """Greedy rows take the argmax: their own rules (none) do not matter."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=8)]
    assert candidates(_logits(2, 4.0), params) is not None


@pytest.mark.parametrize("vocab", [8 * 1024, 151_936], ids=["blocks", "padded tail"])
def test_the_two_level_cdf_picks_the_whole_cumsums_token(vocab: int) -> None:
    """`invert_cdf` (block sums, then one block) against one float64 cumsum over the row: the
    same token for the same uniform, never a token of weight 0 (half the weights are 0 here,
    and u reaches both ends)."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(8, vocab, generator=g) ** 4
    probs[:, ::2] = 0.0
    probs[3, : vocab - 5] = 0.0  # all the mass in the last block's last tokens
    probs = probs / probs.sum(-1, keepdim=True)
    cdf = probs.double().cumsum(-1)
    for seed in range(30):
        u = torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        u[0], u[1] = 0.0, 1.0 - 1e-12
        want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        got = invert_cdf(probs, u)
        assert torch.equal(got, want.clamp(max=vocab - 1))
        assert bool((probs.gather(-1, got.unsqueeze(-1)) > 0).all())
