"""Replicas on Ray Serve, on a local Ray cluster: two replicas of a tiny checkpoint, one CPU
each, behind Serve's proxy on a loopback port. Marked `scale` (a Ray cluster takes a minute to
start on two busy cores): `make test-scale` runs it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from minivllm.scale.ray_serve import REPLICA_HEADER, ReplicaOptions, build_app  # noqa: E402

pytestmark = pytest.mark.scale

API_KEY = "ray-key"
MODEL = "tiny-llama"
GRACE_S = 15  # what in-flight requests get when the app is deleted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tiny_llama_long_dir: Path) -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = ReplicaOptions(
        dict(
            model=str(tiny_llama_long_dir),
            max_model_len=4096,
            num_kv_blocks=256,
            block_size=16,
            max_num_seqs=16,
            device="cpu",
            dtype="float32",
        ),
        served_model_name=MODEL,
        api_key=API_KEY,
        num_cpus=1,
    )
    serve.run(
        build_app(options, num_replicas=2, graceful_shutdown_s=GRACE_S),
        name="minivllm",
        route_prefix="/",
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _stream(client: openai.OpenAI, max_tokens: int) -> tuple[str, openai.Stream]:
    """A streamed completion: the replica that serves it and its stream of chunks."""
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt="Ray replicas",
        max_tokens=max_tokens,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    return raw.headers[REPLICA_HEADER], raw.parse()


def test_both_replicas_serve_concurrent_streams(base_url: str) -> None:
    """Concurrent streamed requests through Serve's proxy spread over both replicas (named by
    the response header) and each completes with every token."""
    client = _client(base_url)
    served: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            replica, chunks = _stream(client, 24)
            served.append((replica, [c.usage for c in chunks][-1].completion_tokens))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(served) == 12
    assert all(n == 24 for _, n in served), served
    assert len({replica for replica, _ in served}) == 2, served
    # The API key is each replica's own check, behind the proxy too.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_each_replica_exports_its_gauges_to_ray(base_url: str) -> None:
    """The node's metrics export port serves every replica's engine gauges, tagged with the
    replica (the proxy's /metrics answers for one replica at a time)."""
    import re

    import httpx

    port = ray.nodes()[0]["MetricsExportPort"]
    replicas: set[str] = set()
    deadline = time.monotonic() + 90
    while len(replicas) < 2:
        assert time.monotonic() < deadline, f"replicas seen in Ray's metrics: {replicas}"
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("ray_minivllm_kv_cache_usage_perc{"):
                replicas.update(re.findall(r'replica="([^"]+)"', line))
        time.sleep(2)


def _scrape(base_url: str) -> tuple[str, dict[str, float]]:
    """(the replica that answered, its /metrics): Serve's proxy picks the replica."""
    import httpx

    r = httpx.get(f"{base_url}/metrics", timeout=30)
    return r.headers[REPLICA_HEADER], {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in r.text.splitlines())
        if name and not name.startswith("#")
    }


def _all_replicas_metrics(base_url: str) -> dict[str, dict[str, float]]:
    """Every replica's /metrics, scraped while none is busy (Serve's router sends a request to
    the less busy of two replicas, so a busy one's /metrics is out of reach)."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(100):
        replica, metrics = _scrape(base_url)
        seen[replica] = metrics
        if len(seen) == 2:
            return seen
    raise AssertionError(f"/metrics reached only {list(seen)}")


def test_client_disconnect_aborts_through_the_proxy(base_url: str) -> None:
    """A streamed client that goes away mid-stream has its request aborted on its replica:
    the replica goes idle having generated far fewer tokens than the request asked for."""
    before = _all_replicas_metrics(base_url)
    replica, stream = _stream(_client(base_url), 4000)
    next(iter(stream))
    stream.close()
    # Serve stops counting the request once the stream closes, so scrapes reach the replica
    # again; the engine's own gauge says whether the request still runs there.
    deadline = time.monotonic() + 120
    while True:
        answered, after = _scrape(base_url)
        if answered == replica and after["minivllm:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, "the request kept running after the disconnect"
        time.sleep(0.2)
    generated = (
        after["minivllm:generation_tokens_total"]
        - before[replica]["minivllm:generation_tokens_total"]
    )
    assert generated < 2000


def _replica_pid(replica: str) -> int:
    from ray.util.state import list_actors

    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.name and replica in actor.name:
            return actor.pid
    raise AssertionError(f"no live actor for replica {replica}")


def _running_replicas() -> int:
    status = serve.status().applications["minivllm"].deployments["MinivllmReplica"]
    return status.replica_states.get("RUNNING", 0)


def test_killed_replica_is_replaced_and_its_streams_end(base_url: str) -> None:
    """SIGKILL one replica's process mid-stream: its in-flight streams end with an error (none
    hangs), the other replica's finish, Serve starts a replacement, later requests succeed."""
    client = _client(base_url)
    streams = [_stream(client, 3000) for _ in range(6)]
    by_replica: dict[str, list[Iterator]] = {}
    for replica, stream in streams:
        chunks = iter(stream)
        next(chunks)  # the request is running on its replica
        by_replica.setdefault(replica, []).append(chunks)
    assert len(by_replica) == 2, list(by_replica)
    victim, survivor = sorted(by_replica, key=lambda r: -len(by_replica[r]))
    os.kill(_replica_pid(victim), signal.SIGKILL)

    outcomes: dict[int, str] = {}

    def drain(i: int, chunks: Iterator, limit: int | None) -> None:
        n = 0
        try:
            for _ in chunks:
                n += 1
                if limit is not None and n >= limit:
                    outcomes[i] = "streaming"
                    return
            outcomes[i] = "ended"
        except openai.APIError as exc:
            outcomes[i] = f"error: {type(exc).__name__}"

    jobs = [(chunks, None) for chunks in by_replica[victim]]
    jobs += [(chunks, 50) for chunks in by_replica[survivor]]
    threads = [
        threading.Thread(target=drain, args=(i, c, lim), daemon=True)
        for i, (c, lim) in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == len(jobs), f"a stream hung: {outcomes}"
    victim_outcomes = [outcomes[i] for i in range(len(by_replica[victim]))]
    survivor_outcomes = [outcomes[i] for i in range(len(by_replica[victim]), len(jobs))]
    # The proxy drops the dead replica's connections: the client sees an error, not a
    # stream that ends as if complete, nor one that waits for ever.
    assert all(o.startswith("error") for o in victim_outcomes), victim_outcomes
    assert all(o == "streaming" for o in survivor_outcomes), survivor_outcomes
    for _, stream in streams:
        stream.close()  # the survivor's: a disconnect aborts them

    deadline = time.monotonic() + 240
    while _running_replicas() < 2:
        assert time.monotonic() < deadline, "Serve did not replace the dead replica"
        time.sleep(1)
    served = set()
    for _ in range(8):
        replica, chunks = _stream(client, 4)
        assert [c.usage for c in chunks][-1].completion_tokens == 4
        served.add(replica)
    assert victim not in served


def test_deleting_the_app_lets_in_flight_streams_finish(base_url: str) -> None:
    """Graceful shutdown (`serve.delete`, as `minivllm serve --ray` does on SIGTERM): a stream
    in flight when the app is deleted still ends with every token it asked for. Runs last:
    it deletes the app."""
    _, stream = _stream(_client(base_url), 2000)  # seconds of streaming, within GRACE_S
    chunks = iter(stream)
    next(chunks)
    deleter = threading.Thread(target=serve.delete, args=("minivllm",), daemon=True)
    deleter.start()
    usage = [c.usage for c in chunks][-1]
    assert deleter.is_alive(), "the stream ended before the delete got to its replica"
    assert usage is not None and usage.completion_tokens == 2000
    deleter.join(GRACE_S + 60)
    assert not deleter.is_alive()
