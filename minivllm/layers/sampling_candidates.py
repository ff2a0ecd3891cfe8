"""Sampling among a row's top candidates instead of its whole vocabulary.

Top-k, top-p and min-p over the whole vocabulary sort every row (`sampler.apply_top_k`,
`apply_top_p`): at 16 rows of Gemma 3's 262k tokens that took 185 ms a step, twice the model's
own step. Every token those rules keep is among a row's largest logits, so a step takes the
`CANDIDATES` largest once (`topk`) and applies the rules there, with the whole vocabulary's
normalisation where top-p needs it. Where a row's rules could keep a token beyond them (no
truncation at all, a top-k larger than them, a nucleus or min-p cut whose edge lies past
them, a tie at the edge), `candidates` answers None and the caller takes the whole-vocabulary
path. The distribution is the whole-vocabulary one up to float rounding; `sample_among` then
inverts each row's CDF over its candidates in token-id order, which is the order the
whole-vocabulary CDF adds them in (its other entries add 0), so a uniform picks the same token.
"""

from __future__ import annotations

import torch

from minivllm.layers.top_rows import topk_rows
from minivllm.sampling_params import SamplingParams

# Candidates a row samples among: enough for a nucleus of 0.95 at temperature 1 on the models
# measured, few enough that the rules cost nothing beside the model's step; a wider nucleus
# tries WIDE_CANDIDATES before the whole vocabulary (16 rows of 262k logits: topk of 1024
# 7 ms, of 8192 22 ms, a sort 190 ms).
CANDIDATES = 1024
WIDE_CANDIDATES = 8192


def candidates(
    scaled: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`scaled` `[N, V]` logits after temperature -> (`[N, m]` logits, -inf where the row's
    top-k / top-p / min-p drop the token; `[N, m]` their token ids), or None where some
    sampling row's rules may keep a token outside its `m` largest."""
    vocab = scaled.shape[-1]
    rules = [p for p in params if not p.greedy]
    widest = min(WIDE_CANDIDATES, vocab)
    if not all(0 < p.top_k <= widest or p.top_p < 1.0 or p.min_p > 0.0 for p in rules):
        return None  # a row that may keep any token
    tiers = [CANDIDATES, widest]
    if rules and all(0 < p.top_k for p in rules):  # first room for ties at the k-th logit
        tiers.insert(0, 2 * max(p.top_k for p in rules))
    for m in sorted({min(m, vocab) for m in tiers}):
        found = _within(scaled, params, m)
        if found is not None:
            return found
    return None


def _within(
    scaled: torch.Tensor, params: list[SamplingParams], m: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`candidates` among each row's `m` largest logits."""
    vocab = scaled.shape[-1]
    values, ids = topk_rows(scaled, m)  # [N, m], largest first
    device = scaled.device
    sampling = torch.tensor([not p.greedy for p in params], device=device)
    top_k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab + 1 for p in params], device=device
    )
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=scaled.dtype, device=device)
    has_k, has_p, has_min = top_k <= m, top_p < 1.0, min_p > 0.0
    if bool((sampling & (top_k <= vocab) & ~has_k).any()):
        return None  # a top-k past the candidates
    keep = torch.ones_like(values, dtype=torch.bool)
    edge = values[:, -1]  # [N] the smallest candidate: every other token is at most this
    # top-k: its k-th logit and every tie of it (the whole-vocabulary rule keeps ties)
    kth = values.gather(-1, (top_k.clamp(max=m) - 1).unsqueeze(-1)).squeeze(-1)  # [N]
    keep &= ~has_k.unsqueeze(-1) | (values >= kth.unsqueeze(-1))
    bounded = has_k & ((edge < kth) | (m == vocab))
    # top-p (HF's rule: drop a token where the ascending cumulative mass up to it is at most
    # 1 - p), normalised over what top-k kept, else over the whole vocabulary
    kept = values.masked_fill(~keep, float("-inf"))
    total = kept.logsumexp(-1)  # [N]
    if bool((has_p & ~has_k).any()):  # those rows' nucleus needs the whole vocabulary's mass
        total = torch.where(has_k, total, scaled.logsumexp(-1))
    probs = (kept - total.unsqueeze(-1)).exp()  # [N, m], whole-vocabulary probabilities
    outside = (1.0 - probs.sum(-1)).clamp(min=0.0)  # [N] mass beyond the candidates
    below = outside.unsqueeze(-1) + probs.flip(-1).cumsum(-1).flip(-1)  # ascending, inclusive
    dropped = below <= (1.0 - top_p).unsqueeze(-1)
    dropped[:, 0] = False  # the most likely token always stays
    keep &= ~(has_p.unsqueeze(-1) & dropped)
    # the nucleus ends inside the candidates where the mass beyond them is dropped with margin
    bounded |= has_p & ~has_k & (outside < (1.0 - top_p) - 1e-4)
    # min-p: against the top token, whatever the normalisation
    floor = values[:, 0] + torch.log(min_p.clamp(min=1e-30))  # [N]
    keep &= ~has_min.unsqueeze(-1) | (values >= floor.unsqueeze(-1))
    bounded |= has_min & (edge < floor)
    if not bool((bounded | ~sampling).all()):
        return None
    return values.masked_fill(~keep, float("-inf")), ids


def sample_among(values: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row: `[N, m]` candidate logits (-inf: dropped) and ids, `[N]` uniforms ->
    `[N]` token ids, each row's CDF over its candidates in token-id order inverted at u."""
    order = ids.argsort(dim=-1)
    probs = values.gather(-1, order).softmax(dim=-1)  # [N, m]
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [N, 1]
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=ids.shape[-1] - 1)
    return ids.gather(-1, order.gather(-1, index)).squeeze(-1)


# Tokens a block of the two-level CDF holds (`invert_cdf`).
CDF_BLOCK = 1024


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`[N, V]` weights (not necessarily normalised), `[N]` uniforms -> `[N]` token ids: each
    row's first token whose cumulative weight exceeds `u` times its total, as one float64
    cumsum over the vocabulary finds it up to rounding, but in two levels: the blocks' sums,
    then one block's own cumsum (the whole-row cumsum and its float64 copy cost 18 of 29 ms at
    16 rows of 262k tokens). Never a token of weight 0."""
    rows, vocab = probs.shape
    pad = -vocab % CDF_BLOCK  # a copy only where the vocabulary is no multiple of a block
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = padded.view(rows, -1, CDF_BLOCK)  # [N, B, 1024]
    ends = blocks.sum(-1).double().cumsum(-1)  # [N, B] cumulative at each block end
    target = (u * ends[:, -1]).unsqueeze(-1)  # [N, 1]
    block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[-1] - 1)
    start = torch.where(block > 0, ends.gather(-1, (block - 1).clamp(min=0)), 0.0)  # [N, 1]
    inside = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, CDF_BLOCK)).squeeze(1)
    cdf = start + inside.double().cumsum(-1)  # [N, 1024]
    at = torch.searchsorted(cdf, target, right=True)  # [N, 1]
    # the two levels' sums may round apart: never past the block's last token of weight > 0
    last = (torch.arange(CDF_BLOCK, device=probs.device) * (inside > 0)).amax(-1, keepdim=True)
    index = block * CDF_BLOCK + torch.minimum(at, last)
    return index.squeeze(-1).clamp_(max=vocab - 1)
