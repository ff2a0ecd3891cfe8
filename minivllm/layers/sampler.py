"""Sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs,
penalties, logit bias, min_tokens and structured outputs' token masks.

vLLM's order: logprobs (with each token's rank in the full vocabulary) are taken from the
raw logits; then the structured-output mask (a packed bitmask for the whole batch, one row
per request), `logit_bias`, the min_tokens ban on EOS and stop tokens, and the repetition /
presence / frequency penalties change the logits (greedy rows too); then temperature and
the filters, with HF's semantics and in HF's order (temperature, top-k, top-p, min-p; top-p
keeps the token that crosses the threshold).
Sampling inverts each row's CDF at one uniform number (a float64 cumulative sum and a binary
search), which draws from `probs` exactly and needs one random number per row, not one per
vocabulary entry (as an exponential race or `torch.multinomial` does). A seeded request draws
its number from a generator seeded by (seed, position), so its tokens depend neither on the
batch it runs in nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.layers.sampling_candidates import CDF_BLOCK, candidates, invert_cdf, sample_among
from minivllm.layers.top_rows import argmax_rows, topk_rows
from minivllm.logprobs import Logprob, logprob_entry
from minivllm.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) over the generator's seed space


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, built from the sequences that sample."""

    params: list[SamplingParams]
    positions: list[int]  # index of the token being sampled in its sequence (for seeds)
    # Each row's tokens so far (the sequence's own list, not a copy) and how many are prompt:
    # read only by the penalties and min_tokens.
    token_ids: list[list[int]] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    # Structured outputs: int32 [N, ceil(V / 32)], bit j of word w allows token 32w + j (all
    # ones for an unconstrained row); None when no row is constrained.
    token_bitmask: torch.Tensor | None = None
    # Speculative decoding: each sequence's draft tokens, when any sequence has some. A
    # sequence with k drafts owns k + 1 consecutive rows (see rejection_sampler.py); None: one
    # row per sequence.
    draft_token_ids: list[list[int]] | None = None

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def max_logprobs(self) -> int | None:
        """The largest top-N asked for in this batch, None if no row wants logprobs."""
        asked = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(asked) if asked else None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # When any row asked for logprobs: per row, the sampled token's entry (its own and the
    # top-N's Logprob, ranks filled; decoded_token is the engine's), None for a row that did not.
    logprobs: list[dict[int, Logprob] | None] | None = None
    # With draft tokens: per sequence, how many the target accepted (before its token).
    num_accepted: list[int] | None = None
    # With draft tokens and logprobs: per sequence, the accepted drafts' entries (None for a
    # sequence that asked for no logprobs).
    draft_logprobs: list[list[dict[int, Logprob]] | None] | None = None


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[dict[int, Logprob]]:
    """Each row's entry for `token_ids[row]`: its log-probability and rank, and the row's
    top-`num_top[row]`. logprobs: [N, V] log-softmax; token_ids: [N]."""
    return tokens_and_logprobs(logprobs, token_ids, num_top)[1]


def tokens_and_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> tuple[list[int], list[dict[int, Logprob]]]:
    """`token_ids` on the host and each row's entry (see `gather_logprobs`).

    The rank is vLLM's count: the tokens whose log-probability is >= the token's own, one
    pass over the batch. Ids, ranks and values travel as one float64 tensor, so a GPU step
    pays one device-to-host copy rather than one per field (float64 holds every token id and
    every float32 value exactly)."""
    own = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [N, 1]
    ranks = (logprobs >= own).sum(dim=-1, keepdim=True)  # [N, 1]
    width = max(max(num_top, default=0), 1)
    top_values, top_ids = topk_rows(logprobs, width)  # [N, K]
    parts = [token_ids.unsqueeze(-1), own, ranks, top_ids, top_values]
    rows = torch.cat([t.to(torch.float64) for t in parts], dim=-1).tolist()  # [N, 3 + 2K]
    tokens = [int(row[0]) for row in rows]
    entries = [
        logprob_entry(
            token,
            row[1],
            int(row[2]),
            [int(i) for i in row[3 : 3 + k]],
            row[3 + width : 3 + width + k],
        )
        for token, row, k in zip(tokens, rows, num_top, strict=True)
    ]
    return tokens, entries


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (`top_k <= 0` keeps all). [N, V] -> [N, V]."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)  # [N]
    sorted_desc = logits.sort(dim=-1, descending=True).values  # [N, V]
    kth = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))  # [N, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's top-p: drop the tokens outside the smallest set whose mass reaches `top_p`, keeping
    the token that crosses it. [N, V] -> [N, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [N, V] ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    remove = cumulative <= (1 - top_p).unsqueeze(-1)
    remove[:, -1] = False  # always keep the most likely token
    mask = torch.zeros_like(remove).scatter(-1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the top token's. [N, V]."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A packed int32 [N, W] token bitmask as bool [N, vocab] (tokens past 32W: not allowed).

    Unpacked byte-wise (one byte per token, read as bool without a copy): a quarter of the
    memory traffic of shifting int32 words."""
    words = bitmask.cpu().numpy()  # [N, W] int32, little-endian bit order within each word
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # [N, 32W] uint8
    allowed = torch.from_numpy(bits).view(torch.bool)  # [N, 32W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def unpack_words(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """`allowed_tokens` by shifts on the words' own device: on an accelerator only the packed
    words (V/8 bytes a row) cross the bus, not a bool per token, and nothing waits on the host."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).bool()  # [N, W, 32]; & 1 ignores sign extension
    allowed = bits.reshape(words.shape[0], -1)  # [N, 32W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The grammar's mask: -inf for every token a row's bitmask does not allow. [N, V]."""
    if logits.device.type == "cpu":
        allowed = allowed_tokens(bitmask, logits.shape[-1])  # [N, V]
    else:
        allowed = unpack_words(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    return torch.where(allowed, logits, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    token_ids: list[list[int]],
    num_prompt_tokens: list[int],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties. [N, V] logits; per row its tokens so far (prompt first) and its three
    penalties, [N] each. Repetition counts prompt and completion tokens (HF's rule); presence
    and frequency count the completion only (OpenAI's)."""
    n, vocab = logits.shape
    device = logits.device
    longest = max((len(t) for t in token_ids), default=0)
    padded = torch.full((n, longest + 1), vocab, dtype=torch.int64)  # id `vocab` = padding
    is_completion = torch.zeros((n, longest + 1), dtype=torch.bool)
    for row, (tokens, num_prompt) in enumerate(zip(token_ids, num_prompt_tokens, strict=True)):
        padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        is_completion[row, num_prompt : len(tokens)] = True
    padded = padded.clamp_(max=vocab).to(device)  # an id past the logits counts as padding
    is_completion = is_completion.to(device)
    counts = torch.zeros((n, vocab + 1), dtype=logits.dtype, device=device)
    counts.scatter_add_(1, padded, is_completion.to(logits.dtype))  # completion occurrences
    seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=device)
    seen.scatter_(1, padded, True)  # in the prompt or the completion
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    penalty = repetition.unsqueeze(-1)  # [N, 1]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(-1) * counts
    return logits - presence.unsqueeze(-1) * (counts > 0).to(logits.dtype)


def _scaled(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's logits over its temperature (greedy rows: 1). [N, V] -> [N, V]."""
    temperature = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in batch.params], device=logits.device
    )
    return logits / temperature.unsqueeze(-1)


def _uniforms(
    batch: SamplingBatch, device: torch.device, generator: torch.Generator, stream: int = 0
) -> torch.Tensor:
    """One u ~ U[0, 1) per row, [N] float64: seeded rows from their own (seed, position)
    generator (`stream` > 0: another independent draw for the same position), the others
    from the engine's."""
    u = torch.rand(len(batch.params), dtype=torch.float64, device=device, generator=generator)
    for row, (params, position) in enumerate(zip(batch.params, batch.positions)):
        if params.seed is not None:
            g = torch.Generator(device=device)
            g.manual_seed((params.seed * _MIX + position + stream * _MIX * _MIX) % (2**63))
            u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return u


def _in_min_tokens(batch: SamplingBatch, row: int) -> bool:
    """Row `row` has not generated its min_tokens yet (EOS and stop tokens are banned)."""
    p = batch.params[row]
    return bool(p.min_tokens) and batch.positions[row] - batch.num_prompt_tokens[row] < p.min_tokens


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Invert each row's CDF at `u`: [N, V] probabilities, [N] uniforms -> [N] token ids.

    Searching for the first entry whose cumulative mass exceeds `u * total` never returns a
    token of probability 0 (its entry equals the one before it). Large vocabularies search
    block sums first (`invert_cdf`)."""
    if probs.shape[-1] > 4 * CDF_BLOCK:
        return invert_cdf(probs, u)
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [N, 1]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [N]
    return index.clamp_(max=probs.shape[-1] - 1)


class Sampler:
    """Turns the last-token logits of the sampling sequences into tokens."""

    def __init__(
        self, seed: int, device: torch.device, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids  # banned, with stop_token_ids, before min_tokens
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] float32, one row per sampling sequence."""
        logits = logits.float()
        wants_logprobs = batch.max_logprobs is not None
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None  # [N, V]
        logits = self.process(logits, batch)

        if batch.all_greedy:
            tokens = argmax_rows(logits)  # [N]
        else:
            tokens = self._sample(logits, batch)

        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist())
        asked = [p.logprobs for p in batch.params]
        token_list, entries = tokens_and_logprobs(raw_logprobs, tokens, [k or 0 for k in asked])
        return SamplerOutput(
            token_list, [e if k is not None else None for e, k in zip(entries, asked)]
        )

    def uniforms(self, batch: SamplingBatch, stream: int = 0) -> torch.Tensor:
        """[N] float64 uniforms, one per row (see `_uniforms`)."""
        return _uniforms(batch, self.device, self.generator, stream)

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The structured-output mask, logit bias, the min_tokens ban and the penalties;
        `logits` itself when none apply. The grammar wins: a row the other rules would leave
        with no token at all (min_tokens banning the EOS its grammar needs) keeps the grammar's
        choice alone."""
        if batch.token_bitmask is None:
            return self._adjust(logits, batch)
        masked = apply_token_bitmask(logits, batch.token_bitmask)  # [N, V]
        adjusted = self._adjust(masked, batch)
        if not any(_in_min_tokens(batch, row) for row in range(len(batch.params))):
            return adjusted  # bias and penalties keep finite logits finite: no row can die
        dead = torch.isneginf(adjusted).all(dim=-1)  # [N]
        return torch.where(dead.unsqueeze(-1), masked, adjusted)

    def _adjust(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logit bias, the min_tokens ban and the penalties; `logits` itself when none apply."""
        params = batch.params
        vocab = logits.shape[-1]
        bias_rows, bias_cols, bias_values, ban_rows, ban_cols = [], [], [], [], []
        for row, p in enumerate(params):
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_cols += list(p.logit_bias)
                bias_values += list(p.logit_bias.values())
            if _in_min_tokens(batch, row):
                stops = set(p.stop_token_ids or ()) | set(
                    () if p.ignore_eos else self.eos_token_ids
                )
                banned = [t for t in stops if t < vocab]
                ban_rows += [row] * len(banned)
                ban_cols += list(banned)
        if bias_rows:
            logits = logits.index_put(
                (
                    torch.tensor(bias_rows, device=logits.device),
                    torch.tensor(bias_cols, device=logits.device),
                ),
                torch.tensor(bias_values, dtype=logits.dtype, device=logits.device),
                accumulate=True,
            )
        if ban_rows:
            logits = logits.index_put(
                (
                    torch.tensor(ban_rows, device=logits.device),
                    torch.tensor(ban_cols, device=logits.device),
                ),
                torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device),
            )
        if any(p.has_penalties for p in params):

            def column(values: list[float]) -> torch.Tensor:
                return torch.tensor(values, dtype=logits.dtype, device=logits.device)

            logits = apply_penalties(
                logits,
                batch.token_ids,
                batch.num_prompt_tokens,
                column([p.repetition_penalty for p in params]),
                column([p.presence_penalty for p in params]),
                column([p.frequency_penalty for p in params]),
            )
        return logits

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = torch.tensor([p.greedy for p in batch.params], device=logits.device)  # [N]
        scaled = _scaled(logits, batch)  # [N, V]
        found = candidates(scaled, batch.params)
        if found is not None:  # every rule's tokens among each row's largest logits
            sampled = sample_among(*found, self.uniforms(batch))  # [N]
        else:
            probs = whole_vocabulary(scaled, batch.params)  # [N, V]
            sampled = sample_from(probs, self.uniforms(batch))  # [N]
        if not bool(greedy.any()):
            return sampled
        return torch.where(greedy, argmax_rows(logits), sampled)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution a row samples from: processed logits through temperature, top-k,
        top-p and min-p (greedy rows at temperature 1, unused). [N, V] -> [N, V]."""
        scaled = _scaled(logits, batch)  # [N, V]
        found = candidates(scaled, batch.params)
        if found is not None:  # the same distribution from each row's largest logits
            values, ids = found
            return torch.zeros_like(scaled).scatter_(-1, ids, values.softmax(dim=-1))
        return whole_vocabulary(scaled, batch.params)


def whole_vocabulary(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, top-p and min-p over every token of each row (`scaled`: logits over temperature),
    then the softmax: the reference `sampling_candidates` keeps to. [N, V] -> [N, V]."""
    device = scaled.device
    if any(p.top_k > 0 for p in params):
        scaled = apply_top_k(scaled, torch.tensor([p.top_k for p in params], device=device))
    if any(p.top_p < 1.0 for p in params):
        scaled = apply_top_p(scaled, torch.tensor([p.top_p for p in params], device=device))
    if any(p.min_p > 0.0 for p in params):
        scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in params], device=device))
    return scaled.softmax(dim=-1)  # [N, V]
