"""The sampler's filters against HF's own logits warpers, and its draws against the maths."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minivllm.layers.sampler import Sampler, SamplingBatch, apply_min_p, apply_top_k, apply_top_p
from minivllm.sampling_params import SamplingParams


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("k", [1, 3, 17, 50])
def test_top_k_matches_hf(logits, k):
    want = TopKLogitsWarper(k)(None, logits.clone())
    got = apply_top_k(logits, torch.full((4,), k))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_matches_hf_keeping_the_crossing_token(logits, p):
    want = TopPLogitsWarper(p)(None, logits.clone())
    got = apply_top_p(logits, torch.full((4,), p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


@pytest.mark.parametrize("m", [0.01, 0.2, 0.9])
def test_min_p_matches_hf(logits, m):
    want = MinPLogitsWarper(m)(None, logits.clone())
    got = apply_min_p(logits, torch.full((4,), m))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_samples_follow_the_distribution():
    """The exponential race draws from softmax(logits / T): frequencies within 3 sigma."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    batch = SamplingBatch([SamplingParams(temperature=1.0)] * 4000, [0] * 4000)
    tokens = torch.tensor(sampler(logits, batch).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    sigma = (probs * (1 - probs) / 4000).sqrt()
    assert ((freq - probs).abs() < 3 * sigma + 1e-3).all(), freq


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    a = Sampler(0, torch.device("cpu"))(logits, SamplingBatch([other, seeded, other], [5, 9, 5]))
    b = Sampler(123, torch.device("cpu"))(logits[[1]], SamplingBatch([seeded], [9]))
    assert a.token_ids[1] == b.token_ids[0]


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = Sampler(0, torch.device("cpu"))(logits, SamplingBatch(params, [0, 0]))
    ref = logits.log_softmax(-1)
    assert out.token_ids == logits.argmax(-1).tolist()
    entry = out.logprobs[0]
    assert entry[out.token_ids[0]].logprob == pytest.approx(ref[0].max().item(), abs=1e-6)
    assert list(entry) == ref[0].topk(3).indices.tolist()  # the top-3, most likely first
    assert out.logprobs[1] is None  # the row asked for no logprobs


def test_logprobs_cross_to_the_host_in_one_copy(monkeypatch):
    """A step with logprobs reads tokens, ranks and top-N back in one copy (each is a sync
    on a GPU), and the entries equal the per-field reading: ids exact, values exact."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in (2, 0, 5)]
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    out = Sampler(0, torch.device("cpu"))(logits, SamplingBatch(params, [0, 0, 0]))
    monkeypatch.undo()
    assert len(reads) == 1
    ref = logits.log_softmax(-1)
    assert out.token_ids == ref.argmax(-1).tolist()
    for row, entry in enumerate(out.logprobs):
        top = ref[row].topk(max(params[row].logprobs, 1))
        want = {int(t): float(v) for t, v in zip(top.indices[: params[row].logprobs], top.values)}
        want.setdefault(out.token_ids[row], float(ref[row].max()))
        assert {t: e.logprob for t, e in entry.items()} == want
        assert entry[out.token_ids[row]].rank == 1


def test_inverse_cdf_never_picks_a_filtered_token():
    """Tokens of probability 0 (filtered by top-k/p/min-p) are never drawn, even at u's edges."""
    from minivllm.layers.sampler import sample_from

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.4999999, 0.5, 1.0 - 1e-12], dtype=torch.float64)
    assert sample_from(probs, u).tolist() == [1, 1, 3, 3]
