"""Prometheus metrics, named like vLLM's (`minivllm:` for `vllm:`), in one registry per app.

Gauges and the engine's own counters are read at scrape time from the engine thread's last
stats snapshot; token counters and latency histograms are fed by the engine thread as each
step's outputs are delivered (`ServerMetrics.on_output`).

The engine's gauges and counters are also exported under vLLM's own names, with vLLM's
`model_name` label (`vllm:num_requests_waiting{model_name="..."}`): the routers and gateways
that pick a replica by queue length or KV usage (vllm-router, sglang-router, the Kubernetes
Gateway API inference extension) scrape those names and no others. They are aliases, not a
rename: dashboards built on the `minivllm:` names keep working. Accepted draft tokens by draft
position carry vLLM's `position` label (`vllm:spec_decode_num_accepted_tokens_per_pos`), one
series per position 0 .. k - 1 when the engine speculates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.engine.spec_decode import PER_POSITION_KEY, per_position
from minivllm.outputs import RequestOutput

_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0 to 1).",
}
# Measured once at start-up (minivllm/engine/memory.py); minivllm's own, no vLLM alias.
_MEMORY_GAUGES = {
    "model_weights_bytes": "Bytes of the model's weights in memory (a memory-mapped GGUF "
    "tensor counted once).",
    "kv_cache_bytes": "Bytes of the KV-cache pool.",
    "kv_cache_num_blocks": "Blocks in the KV-cache pool.",
    "kv_cache_capacity_tokens": "Tokens the KV-cache pool holds (blocks x block size; an "
    "int8 or fp8 cache, kv_cache_dtype, holds about twice bf16's in the same bytes).",
    "startup_peak_rss_bytes": "Peak resident memory of the engine process at the end of "
    "start-up (loading the weights, allocating the KV pool).",
}
_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Sequences preempted (by recompute) since start.",
    "spec_decode_num_drafts": "Speculative steps of a sequence (steps that verified drafts).",
    "spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens the target model accepted.",
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineStatsCollector(Collector):
    def __init__(self, read_stats: Callable[[], dict[str, float]], model_name: str) -> None:
        self.read_stats = read_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        for name, doc in _GAUGES.items():
            value = float(stats.get(name, 0))
            yield GaugeMetricFamily(f"minivllm:{name}", doc, value=value)
            alias = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            alias.add_metric([self.model_name], value)
            yield alias
        for name, doc in _MEMORY_GAUGES.items():
            if name in stats:
                yield GaugeMetricFamily(f"minivllm:{name}", doc, value=float(stats[name]))
        for name, doc in _COUNTERS.items():
            value = float(stats.get(name, 0))
            yield CounterMetricFamily(f"minivllm:{name}", doc, value=value)
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        counts = per_position(stats)
        if counts:
            yield from self._per_position(counts)

    def _per_position(self, counts: list[float]) -> Iterator[Metric]:
        doc = "Accepted draft tokens by their position in the draft (0: the first)."
        own = CounterMetricFamily(f"minivllm:{PER_POSITION_KEY}", doc, labels=["position"])
        alias = CounterMetricFamily(
            f"vllm:{PER_POSITION_KEY}", doc, labels=["model_name", "position"]
        )
        for j, count in enumerate(counts):
            own.add_metric([str(j)], float(count))
            alias.add_metric([self.model_name, str(j)], float(count))
        yield own
        yield alias


class ServerMetrics:
    """The server's metrics in their own CollectorRegistry (two apps never share one).
    `model_name`: the served model's name, the `model_name` label of the vLLM aliases."""

    def __init__(self, read_stats: Callable[[], dict[str, float]], model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(read_stats, model_name))
        self.prompt_tokens = Counter(
            "minivllm:prompt_tokens", "Prompt tokens processed.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "minivllm:generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "minivllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "minivllm:time_per_output_token_seconds",
            "Mean time between generated tokens, per request.",
            buckets=(0.001, 0.0025, *_LATENCY_BUCKETS),
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "minivllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def on_output(self, output: RequestOutput, new_tokens: int) -> None:
        """Count one delivered output (called on the engine thread)."""
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
        if not output.finished or output.metrics is None:
            return
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        m = output.metrics
        if m.first_token_time is not None:
            self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e_request_latency.observe(m.finished_time - m.arrival_time)
            num_tokens = len(output.outputs[0].token_ids)
            if m.first_token_time is not None and num_tokens > 1:
                tpot = (m.finished_time - m.first_token_time) / (num_tokens - 1)
                self.time_per_output_token.observe(tpot)
