"""/metrics of a multi-model server: every loaded model's metrics (metrics.py), each series
labelled with vLLM's `model_name`, plus the registry's own per model: its state, the
requests waiting for it to load, its loads and how long the last one took."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.server.model_registry import ModelRegistry, ModelState


class MultiModelCollector(Collector):
    """Merges the loaded models' registries (`registries()`: name -> registry) into one
    family per metric name, a `model_name` label on every sample (the vLLM aliases already
    carry it), and adds the registry's gauges."""

    def __init__(
        self, models: ModelRegistry, registries: Callable[[], dict[str, CollectorRegistry]]
    ) -> None:
        self.models = models
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for name, registry in self.registries().items():
            for family in registry.collect():
                out = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {"model_name": name, **sample.labels}
                    out.samples.append(sample._replace(labels=labels))
        yield from merged.values()
        yield from self._registry_metrics()

    def _registry_metrics(self) -> Iterator[Metric]:
        label = ["model_name"]
        state = GaugeMetricFamily(
            "minivllm:model_state",
            "1 for the model's current state (unloaded, loading, loaded, failed), else 0.",
            labels=["model_name", "state"],
        )
        waiting = GaugeMetricFamily(
            "minivllm:model_requests_waiting_for_load",
            "Requests waiting for the model to load.",
            labels=label,
        )
        in_flight = GaugeMetricFamily(
            "minivllm:model_requests_in_flight", "Requests using the model.", labels=label
        )
        loads = CounterMetricFamily(
            "minivllm:model_loads", "Completed loads of the model.", labels=label
        )
        load_s = GaugeMetricFamily(
            "minivllm:model_last_load_seconds", "Seconds the model's last load took.", labels=label
        )
        for entry in self.models.entries.values():
            for s in ModelState:
                state.add_metric([entry.name, s.value], float(entry.state is s))
            waiting.add_metric([entry.name], entry.waiting)
            in_flight.add_metric([entry.name], entry.in_flight)
            loads.add_metric([entry.name], entry.loads)
            if entry.last_load_s is not None:
                load_s.add_metric([entry.name], entry.last_load_s)
        yield from (state, waiting, in_flight, loads, load_s)
