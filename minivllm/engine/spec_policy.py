"""When speculation pays: the cost model the Scheduler asks before it proposes drafts.

A step's time is a fixed part (reading the weights, launching the step) plus a part per token
it runs: t(N) = t0 * (1 + c * N), with c = `draft_token_cost` (measured on the loaded model
at start-up: `spec_cost.py`). A decode batch of B sequences yields B tokens in t(B). Giving
one of them k drafts, accepted at rate a, yields a * k more tokens for c * k * t0 more time,
which raises the step's tokens per second exactly when

    a > B * c / (1 + B * c)        (the "break-even acceptance" at batch size B)

so at one sequence almost any acceptance pays, and as the batch grows the per-token share of
the step approaches 1 and nothing does. Two rules follow:
- the batch rule: with `disable_by_batch_size` or more running sequences nobody speculates
  (vLLM's key of that name; beyond it the verification step's own overheads, which the linear
  model leaves out, outweigh what the drafts can still win);
- the request rule: a sequence proposes only while its acceptance so far (its last verified
  steps, from an even prior) beats the break-even at the current batch size. A sequence below
  it still probes: first after `PROBE_INTERVAL` decode steps, then as often as keeps failed
  probes under `PROBE_BUDGET` of the time (`probe_interval`), so an answer that starts quoting
  its prompt later is noticed; in a batch of B every sequence probes, so the intervals stretch
  until their probes together cost what one sequence's do alone (`batch_probe_interval`).

Pure Python: the decisions are a function of counts, tested without a clock.
"""

from __future__ import annotations

import math
from collections import deque

from minivllm.config import SpeculativeConfig

# The cost when nobody measured it (an engine built on a runner by hand): the default
# model's, the smallest c measured (docs/benchmarks.md).
DEFAULT_DRAFT_TOKEN_COST = 0.05
WINDOW = 8  # verified steps a sequence's acceptance estimate looks back over
PRIOR_DRAFTED, PRIOR_ACCEPTED = 2, 1  # an even prior: a new sequence starts at 1/2
PROBE_INTERVAL = 8  # decode steps a sequence below break-even waits before trying again
# ... at least; a failed probe costs k * c / (1 + c) one-token steps, so where verifying is
# dear the interval grows until failed probes cost at most this share of the steps.
PROBE_BUDGET = 0.02


def probe_interval(token_cost: float, num_speculative_tokens: int) -> int:
    """Decode steps between probes of a sequence that has verified drafts and fell below
    break-even: PROBE_INTERVAL, or more where a probe's k drafts cost more than PROBE_BUDGET
    of that many steps."""
    probe = num_speculative_tokens * token_cost / (1.0 + token_cost)
    return max(PROBE_INTERVAL, math.ceil(probe / PROBE_BUDGET))


def batch_probe_interval(interval: int, batch_size: int, token_cost: float) -> int:
    """A probe interval for one sequence, stretched for a batch of `batch_size`: a probe's k
    drafts cost k * c / (1 + B * c) of a B-sequence step, and each of the B sequences probes,
    so failed probes take the same share of the time as one sequence's do every `interval`."""
    share = batch_size * (1.0 + token_cost) / (1.0 + batch_size * token_cost)
    return max(interval, math.ceil(interval * share))


def break_even_acceptance(batch_size: int, token_cost: float) -> float:
    """The acceptance rate a draft token needs to pay in a batch of `batch_size` decodes."""
    share = batch_size * token_cost
    return share / (1.0 + share)


class SpeculationPolicy:
    """The batch rule and the request rule above, with each running sequence's record."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size
        cost = config.draft_token_cost
        self.token_cost = DEFAULT_DRAFT_TOKEN_COST if cost is None else cost
        self.probe_interval = probe_interval(self.token_cost, config.num_speculative_tokens)
        self._history: dict[int, deque[tuple[int, int]]] = {}  # (drafted, accepted) per step
        self._waited: dict[int, int] = {}  # decode steps skipped since the last proposal

    def batch_allows(self, batch_size: int) -> bool:
        """False at or beyond `disable_by_batch_size` running sequences."""
        return self.disable_by_batch_size is None or batch_size < self.disable_by_batch_size

    def acceptance(self, seq_id: int) -> float:
        """The sequence's estimated acceptance rate per draft token."""
        steps = self._history.get(seq_id, ())
        drafted = PRIOR_DRAFTED + sum(d for d, _ in steps)
        accepted = PRIOR_ACCEPTED + sum(a for _, a in steps)
        return accepted / drafted

    def should_propose(self, seq_id: int, batch_size: int) -> bool:
        """Whether this decoding sequence proposes drafts this step (a probe counts as yes)."""
        if not self.batch_allows(batch_size):
            return False
        if self.acceptance(seq_id) > break_even_acceptance(batch_size, self.token_cost):
            return True
        waited = self._waited.get(seq_id, 0) + 1
        # A sequence that never verified a draft probes soon: its answer may be a quote.
        interval = self.probe_interval if seq_id in self._history else PROBE_INTERVAL
        interval = batch_probe_interval(interval, batch_size, self.token_cost)
        if waited >= interval:
            self._waited[seq_id] = 0
            return True
        self._waited[seq_id] = waited
        return False

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """One verified step of the sequence."""
        self._history.setdefault(seq_id, deque(maxlen=WINDOW)).append((drafted, accepted))

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop its record."""
        self._history.pop(seq_id, None)
        self._waited.pop(seq_id, None)
