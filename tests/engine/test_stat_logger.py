"""The engine's periodic log line: once per interval, the change of the counters since the
last line, with the mean acceptance length when the engine speculates."""

from __future__ import annotations

from minivllm.engine.spec_decode import SpecDecodeStats
from minivllm.engine.stat_logger import StatLogger, format_stats


def stats_after(steps: list[tuple[int, int]], k: int = 3) -> dict[str, float]:
    spec = SpecDecodeStats(k)
    for drafts, accepted in steps:
        spec.observe(drafts, accepted)
    return {
        "num_requests_running": 2,
        "num_requests_waiting": 1,
        "kv_cache_usage_perc": 0.25,
        "prefix_cache_queries": 10,
        "prefix_cache_hits": 4,
        **spec.as_stats(),
    }


def test_the_line_reports_the_mean_acceptance_length_since_the_last_line():
    before = stats_after([(3, 3)])
    now = stats_after([(3, 3), (3, 1), (3, 0)])
    line = format_stats(now, before, 10.0)
    assert "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in line
    # Since `before`: 2 drafts, 1 accepted token -> 1 + 1 / 2.
    assert "Mean acceptance length: 1.50" in line
    assert "Accepted: 1 tokens, Drafted: 6 tokens" in line
    assert "Per-position acceptance rate: 0.500, 0.000, 0.000" in line
    assert "Prefix cache" not in line  # no new lookups since `before`


def test_an_engine_that_does_not_speculate_logs_no_spec_part():
    line = format_stats(
        {"num_requests_running": 1, "prefix_cache_queries": 8, "prefix_cache_hits": 2}, {}, 10.0
    )
    assert "SpecDecoding" not in line and "Prefix cache hit rate: 25.0%" in line


def test_it_logs_once_per_interval(caplog):
    clock = [0.0]
    logger = StatLogger(interval=10.0, clock=lambda: clock[0])
    clock[0] = 4.0
    assert logger.record(stats_after([(3, 2)])) is None
    clock[0] = 11.0
    with caplog.at_level("INFO", logger="minivllm.engine"):
        line = logger.record(stats_after([(3, 2)]))
    assert line is not None and "Mean acceptance length: 3.00" in line
    assert line in caplog.text
    clock[0] = 15.0
    assert logger.record(stats_after([(3, 2)])) is None
