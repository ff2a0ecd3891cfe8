"""Helpers the server tests share: reading /metrics and waiting for an idle engine."""

from __future__ import annotations

import time

import httpx


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's Prometheus metrics as {name (with labels): value}."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_idle(base_url: str, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits (or `timeout` passes); the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(base_url)
        idle = m["minivllm:num_requests_running"] == 0
        idle = idle and m["minivllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.02)
