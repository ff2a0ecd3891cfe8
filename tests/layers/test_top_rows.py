"""`argmax_rows` and `topk_rows` give torch's answers: argmax the same index (the first of
the maximum), a top-k the same values at indices holding them, on rows long enough for the
two-pass path and not, with ties (small integers) and -inf (masked tokens)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.layers.top_rows import CHUNK, argmax_rows, topk_rows


def _logits(seed: int, rows: int, vocab: int, ties: bool, masked: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-3, 4, (rows, vocab), generator=generator).float()
    else:
        x = torch.randn(rows, vocab, generator=generator)
    if masked:
        x[torch.rand(rows, vocab, generator=generator) < 0.5] = float("-inf")
    return x


SHAPES = dict(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 4),
    vocab=st.one_of(st.integers(1, 3000), st.sampled_from([2 * CHUNK, 5 * CHUNK, 5 * CHUNK + 7])),
    ties=st.booleans(),
    masked=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(**SHAPES)
def test_argmax_rows_is_torchs(seed: int, rows: int, vocab: int, ties: bool, masked: bool) -> None:
    x = _logits(seed, rows, vocab, ties, masked)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 40), **SHAPES)
def test_topk_rows_is_torchs(
    seed: int, rows: int, vocab: int, ties: bool, masked: bool, k: int
) -> None:
    x = _logits(seed, rows, vocab, ties, masked)
    k = min(k, vocab)
    values, index = topk_rows(x, k)
    assert torch.equal(values, x.topk(k, dim=-1).values)
    assert torch.equal(x.gather(1, index), values)
    assert all(len(set(row.tolist())) == k for row in index)


def test_a_nan_logit_is_the_argmax_as_in_torch() -> None:
    """torch's argmax takes a NaN as the largest (the first one): so does ours, wherever the
    NaN lies (the chunks, or the elements past them, or both)."""
    vocab = 5 * CHUNK + 7
    for places in ([3], [vocab - 2], [2 * CHUNK + 1, vocab - 1], [vocab - 5, vocab - 1]):
        x = torch.randn(2, vocab, generator=torch.Generator().manual_seed(len(places)))
        x[0, places] = float("nan")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), places


def test_a_whole_gemma_row_takes_the_two_pass_path() -> None:
    """262k logits (Gemma 3's vocabulary): the chunked path, the same answers."""
    x = torch.randn(3, 262144, generator=torch.Generator().manual_seed(0))
    x[1, 262143] = 100.0  # the maximum in the last chunk
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    for k in (16, 1024):
        values, index = topk_rows(x, k)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, index), values)


def test_the_elements_past_the_last_whole_chunk_count() -> None:
    """A vocabulary that is no multiple of the chunk: the row's largest values in its tail."""
    x = torch.randn(2, 151936 + 7, generator=torch.Generator().manual_seed(1))  # Qwen2's + 7
    x[0, -1], x[0, -4], x[1, -7] = 100.0, 90.0, 80.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    for k in (1, 2, 16):
        values, index = topk_rows(x, k)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, index), values)
