"""/metrics' spec-decode series, read back the way `minivllm bench serve` and vLLM's users read
them: the totals and the per-position counts under vLLM's names and labels."""

from __future__ import annotations

from prometheus_client import generate_latest

from minivllm.bench.serve import acceptance, spec_counters
from minivllm.engine.spec_decode import SpecDecodeStats
from minivllm.server.metrics import ServerMetrics


def metrics_text(steps: list[tuple[int, int]], k: int = 3) -> str:
    spec = SpecDecodeStats(k)
    for drafts, accepted in steps:
        spec.observe(drafts, accepted)
    metrics = ServerMetrics(lambda: spec.as_stats(), model_name="tiny")
    return generate_latest(metrics.registry).decode()


def test_per_position_counts_carry_vllms_name_and_labels():
    text = metrics_text([(3, 3), (3, 1)])
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="tiny",position="0"}} 2.0' in text
    assert f'{per_pos}{{model_name="tiny",position="2"}} 1.0' in text
    assert 'minivllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 2.0' in text


def test_an_engine_without_speculation_exports_no_per_position_series():
    assert "per_pos" not in metrics_text([], k=0)


def test_bench_serve_reads_the_acceptance_of_a_level():
    before = spec_counters(metrics_text([(3, 3)]))
    after = spec_counters(metrics_text([(3, 3), (3, 1), (2, 0), (3, 2)]))
    spec = acceptance(before, after)
    assert spec is not None
    assert spec["num_drafts"] == 3 and spec["num_draft_tokens"] == 8
    assert spec["acceptance_rate"] == 3 / 8
    assert spec["mean_acceptance_length"] == 2.0
    assert spec["per_position_acceptance"] == [2 / 3, 1 / 3, 0.0]
    assert acceptance(after, after) is None
