"""Verifying draft tokens against the target model: vLLM's acceptance rules for a draft that
proposes one token with certainty (n-gram prompt lookup).

Rows: a sequence with k drafts owns k + 1 consecutive rows of the step's logits, row j scoring
the token after draft j (row 0: after the sequence's last token). Every row is processed like
an ordinary sampling row (mask, bias, min_tokens, penalties over the tokens before it), so the
acceptance tests the distribution the request would sample from.

- Greedy: accept the longest prefix of drafts equal to the rows' argmax; the token after it is
  the argmax of the first row not accepted (the bonus row when all were).
- Sampled (Leviathan et al. / Chen et al.): the draft distribution q puts all its mass on the
  draft d, so d is accepted with probability min(1, p(d) / q(d)) = p(d); on a rejection the
  token is drawn from norm(max(0, p - q)), which is p with d removed and renormalized; after
  k acceptances the bonus token is drawn from the last row's p. The output is distributed
  exactly as the target's.
"""

from __future__ import annotations

import torch

from minivllm.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    gather_logprobs,
    sample_from,
)
from minivllm.layers.top_rows import argmax_rows
from minivllm.logprobs import Logprob


def accept_greedy(drafts: list[int], targets: list[int]) -> int:
    """How many drafts greedy verification accepts: the longest prefix of `drafts` equal to the
    target's argmax at the same positions (`targets` has one more entry, the bonus)."""
    accepted = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        accepted += 1
    return accepted


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Accept or reject each sequence's drafts, and pick the target's token after them.

    logits: [R, V] raw, R = sum(k + 1) over the sequences of `batch.draft_token_ids`; `batch`
    has one entry per row (params, positions, token ids with the drafts before the row).
    Returns one token per sequence, with `num_accepted`; logprobs (when asked for) are of that
    token and of the accepted drafts, each from its own row."""
    drafts = batch.draft_token_ids
    assert drafts is not None, "verify needs draft tokens"
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs is not None else None
    processed = sampler.process(logits, batch)  # [R, V]
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    assert row == logits.shape[0], (row, logits.shape)
    greedy = [batch.params[start].greedy for start in starts]
    probs = None if all(greedy) else sampler.probabilities(processed, batch)  # [R, V]
    # A draft row's acceptance draw, and a second, independent one for its rejection; a
    # bonus row samples with its first draw, as a step without drafts would.
    first = sampler.uniforms(batch)  # [R]
    is_draft = torch.ones(row, dtype=torch.bool, device=first.device)
    is_draft[[start + len(d) for start, d in zip(starts, drafts)]] = False
    second = torch.where(is_draft, sampler.uniforms(batch, stream=1), first)  # [R]
    tokens, accepted, rows = accept(processed, probs, drafts, greedy, first, second)
    if raw_logprobs is None:
        return SamplerOutput(tokens, num_accepted=accepted)
    logprobs, draft_logprobs = run_logprobs(raw_logprobs, batch, starts, drafts, accepted, tokens)
    return SamplerOutput(tokens, logprobs, accepted, draft_logprobs)


def run_logprobs(
    raw_logprobs: torch.Tensor,
    batch: SamplingBatch,
    starts: list[int],
    drafts: list[list[int]],
    accepted: list[int],
    tokens: list[int],
) -> tuple[list[dict[int, Logprob] | None], list[list[dict[int, Logprob]] | None]]:
    """The entries of every token a sequence keeps, each from its own row: the accepted
    drafts' (row j for draft j) and the final token's (the row after them), as a step
    without drafts would have given each. raw_logprobs: [R, V]. Returns (final token's entry,
    accepted drafts' entries), per sequence; None where the request asked for none."""
    row_ids: list[int] = []
    row_tokens: list[int] = []
    for start, d, n, token in zip(starts, drafts, accepted, tokens):
        row_ids.extend(range(start, start + n + 1))
        row_tokens.extend([*d[:n], token])
    device = raw_logprobs.device
    chosen = torch.tensor(row_ids, dtype=torch.int64, device=device)
    wants = [batch.params[r].logprobs or 0 for r in row_ids]
    entries = gather_logprobs(
        raw_logprobs[chosen], torch.tensor(row_tokens, dtype=torch.int64, device=device), wants
    )
    finals: list[dict[int, Logprob] | None] = []
    runs: list[list[dict[int, Logprob]] | None] = []
    at = 0
    for start, n in zip(starts, accepted):
        asked = batch.params[start].logprobs is not None
        finals.append(entries[at + n] if asked else None)
        runs.append(entries[at : at + n] if asked else None)
        at += n + 1
    return finals, runs


def accept(
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    drafts: list[list[int]],
    greedy: list[bool],
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
) -> tuple[list[int], list[int], list[int]]:
    """Per sequence: (the token after its accepted drafts, how many drafts it accepted, the row
    that token came from).

    logits: [R, V] processed logits (argmax for greedy rows); probs: [R, V] the rows' final
    distribution (None if every sequence is greedy); drafts: per sequence; greedy: per
    sequence; u_accept, u_resample: [R] uniforms.

    What the host reads (argmax, uniforms, the drafts' probabilities, the recovered tokens)
    crosses as one float64 tensor: one device-to-host copy a step (float64 holds every token
    id, float32 probability and float64 uniform exactly)."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    argmax, accept_u, draft_prob, recovered = _host_reads(
        logits, probs, drafts, starts, u_accept, u_resample
    )
    tokens, accepted, rows = [], [], []
    flat = 0  # index of the sequence's first draft in draft_prob
    for start, d, is_greedy in zip(starts, drafts, greedy):
        if is_greedy:
            n = accept_greedy(d, argmax[start : start + len(d) + 1])
            token = argmax[start + n]
        else:
            n = 0
            while n < len(d) and accept_u[start + n] < draft_prob[flat + n]:
                n += 1
            token = recovered[start + n]
        flat += len(d)
        tokens.append(token)
        accepted.append(n)
        rows.append(start + n)
    return tokens, accepted, rows


def _host_reads(
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    drafts: list[list[int]],
    starts: list[int],
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
) -> tuple[list[int], list[float], list[float], list[int]]:
    """What `accept` reads on the host: each row's argmax and acceptance uniform, and with
    `probs` each draft's probability and each row's recovered token (sampled from the row's
    distribution without its draft), in one copy."""
    num_rows = logits.shape[0]
    parts = [argmax_rows(logits), u_accept.to(logits.device)]  # [R], [R]
    if probs is not None:
        draft_rows = torch.tensor(
            [start + j for start, d in zip(starts, drafts) for j in range(len(d))],
            dtype=torch.int64,
            device=probs.device,
        )
        draft_ids = torch.tensor(
            [t for d in drafts for t in d], dtype=torch.int64, device=probs.device
        )
        parts.append(probs[draft_rows, draft_ids])  # [D] p(d) of each draft
        # Each draft row without its draft (the rejection's distribution); bonus rows as is.
        zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
        residual = probs.index_put((draft_rows, draft_ids), zero)  # [R, V]
        parts.append(sample_from(residual, u_resample))  # [R] recovered tokens
    host = torch.cat([p.to(torch.float64) for p in parts]).tolist()
    argmax = [int(v) for v in host[:num_rows]]
    accept_u = host[num_rows : 2 * num_rows]
    if probs is None:
        return argmax, accept_u, [], []
    draft_prob = host[2 * num_rows : len(host) - num_rows]
    return argmax, accept_u, draft_prob, [int(v) for v in host[len(host) - num_rows :]]
