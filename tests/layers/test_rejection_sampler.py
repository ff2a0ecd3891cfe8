"""Draft verification against hand-made distributions, and the sampler rows a plan with drafts
becomes: the pieces of speculative decoding that need torch but no model."""

from __future__ import annotations

from collections import Counter

import torch

from minivllm.engine.model_runner import sampling_batch
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence
from minivllm.layers.rejection_sampler import accept, accept_greedy
from minivllm.sampling_params import SamplingParams


def test_greedy_acceptance_is_the_longest_prefix_equal_to_the_target():
    """A draft counts only while every draft before it matched: the first mismatch ends it."""
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == 3


def test_greedy_accepts_the_prefix_equal_to_the_argmax_and_takes_the_next_argmax():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 5, 1]):  # the target's argmax after each position
        logits[row, best] = 5.0
    tokens, accepted, rows = accept(
        logits, None, [[2, 3, 4]], [True], torch.zeros(4), torch.zeros(4)
    )
    assert (tokens, accepted, rows) == ([5], [2], [2])  # drafts 2, 3 accepted; 4 != 5


def test_sampled_acceptance_gives_the_targets_distribution():
    """Many sequences with one draft each: the first token's frequencies match p, whether
    the draft is likely, unlikely or impossible under p."""
    p = torch.tensor([0.1, 0.5, 0.3, 0.1, 0.0])
    n = 20000
    generator = torch.Generator().manual_seed(0)
    for draft in [1, 3, 4]:
        probs = p.repeat(2 * n, 1)  # [2n, V]: rows (after the last token, after the draft)
        u1 = torch.rand(2 * n, dtype=torch.float64, generator=generator)
        u2 = torch.rand(2 * n, dtype=torch.float64, generator=generator)
        tokens, accepted, _ = accept(probs.log(), probs, [[draft]] * n, [False] * n, u1, u2)
        # The first token is the accepted draft or the correction.
        first = Counter(draft if a else t for t, a in zip(tokens, accepted))
        freq = torch.tensor([first[i] / n for i in range(5)])
        assert (freq - p).abs().sum() / 2 < 0.02, (draft, freq)
        assert first[4] == 0


def test_one_host_copy_a_step_and_the_same_answer(monkeypatch):
    """The host reads argmax, uniforms, draft probabilities and recovered tokens in one copy
    (each read is a sync on a GPU); a mixed greedy and sampled batch gives the answer of the
    rule spelled out by hand."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(5, 7, generator=gen), dim=-1)  # seq 0: 2 rows, seq 1: 3
    drafts, greedy = [[4], [1, 2]], [True, False]
    u1 = torch.rand(5, dtype=torch.float64, generator=gen)
    u2 = torch.rand(5, dtype=torch.float64, generator=gen)
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    tokens, accepted, rows = accept(probs.log(), probs, drafts, greedy, u1, u2)
    monkeypatch.undo()
    assert len(reads) == 1
    argmax = probs.argmax(-1).tolist()
    n0 = 1 if argmax[0] == 4 else 0
    n1 = 0
    while n1 < 2 and u1[2 + n1] < probs[2 + n1, drafts[1][n1]]:
        n1 += 1
    assert accepted == [n0, n1] and rows == [n0, 2 + n1]
    assert tokens[0] == argmax[n0]


def test_every_draft_row_sees_the_drafts_before_it():
    """Row j scores the token after draft j: its position is num_tokens + j and, for the
    penalties, its history holds drafts[:j]."""
    seq = Sequence(0, [1, 2, 3], SamplingParams(repetition_penalty=1.2))
    seq.token_ids.append(9)
    seq.num_tokens = 4
    seq.num_cached_tokens, seq.num_scheduled_tokens = 3, 3
    seq.spec_token_ids = [7, 8]
    other = Sequence(1, [4, 5], SamplingParams())
    other.num_scheduled_tokens = 2
    rows = sampling_batch(ScheduledBatch([seq, other]))
    assert rows.positions == [4, 5, 6, 2]
    assert rows.token_ids[:3] == [[1, 2, 3, 9], [1, 2, 3, 9, 7], [1, 2, 3, 9, 7, 8]]
    assert rows.draft_token_ids == [[7, 8], []]
    assert rows.params == [seq.sampling_params] * 3 + [other.sampling_params]
