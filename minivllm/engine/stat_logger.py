"""The engine's periodic log line, vLLM's `LoggingStatLogger` in small: every `interval` seconds
of work, one line with the queues, the KV cache, the prefix cache hit rate and, when the engine
speculates, the mean acceptance length of the drafts verified since the last line.

It reads only `engine.stats()` dicts (the counters are cumulative; the line reports their
change since the last line), so it runs wherever a copy of the stats is: the server's engine
loop feeds it after every step. Pure Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from minivllm.engine.spec_decode import mean_acceptance_length, per_position

logger = logging.getLogger("minivllm.engine")

DEFAULT_INTERVAL_S = 10.0  # vLLM's default log interval


def _delta(now: dict[str, float], before: dict[str, float], key: str) -> float:
    return now.get(key, 0.0) - before.get(key, 0.0)


def format_stats(now: dict[str, float], before: dict[str, float], seconds: float) -> str:
    """The log line for the change from `before` to `now` over `seconds`."""
    parts = [
        f"Running: {int(now.get('num_requests_running', 0))} reqs",
        f"Waiting: {int(now.get('num_requests_waiting', 0))} reqs",
        f"KV cache usage: {now.get('kv_cache_usage_perc', 0.0):.1%}",
    ]
    queries = _delta(now, before, "prefix_cache_queries")
    if queries:
        hits = _delta(now, before, "prefix_cache_hits")
        parts.append(f"Prefix cache hit rate: {hits / queries:.1%}")
    line = ", ".join(parts)
    drafts = _delta(now, before, "spec_decode_num_drafts")
    mean = mean_acceptance_length(drafts, _delta(now, before, "spec_decode_num_accepted_tokens"))
    if mean is not None:
        draft_tokens = _delta(now, before, "spec_decode_num_draft_tokens")
        accepted = _delta(now, before, "spec_decode_num_accepted_tokens")
        earlier = per_position(before)
        rates = [
            (count - (earlier[j] if j < len(earlier) else 0.0)) / drafts
            for j, count in enumerate(per_position(now))
        ]
        line += (
            f"; SpecDecoding: Mean acceptance length: {mean:.2f}, "
            f"Accepted: {int(accepted)} tokens, Drafted: {int(draft_tokens)} tokens, "
            f"Acceptance rate: {accepted / draft_tokens:.1%}, "
            f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in rates)}, "
            f"over {seconds:.1f} s"
        )
    return line


class StatLogger:
    """Logs `format_stats` at most once per `interval` seconds; fed after steps only, so an
    idle engine logs nothing."""

    def __init__(
        self, interval: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self._last_time = clock()
        self._last_stats: dict[str, float] = {}

    def record(self, stats: dict[str, float]) -> str | None:
        """After a step: log (and return) the line if `interval` has passed since the last."""
        now = self.clock()
        if now - self._last_time < self.interval:
            return None
        line = format_stats(stats, self._last_stats, now - self._last_time)
        logger.info("%s", line)
        self._last_time, self._last_stats = now, dict(stats)
        return line
