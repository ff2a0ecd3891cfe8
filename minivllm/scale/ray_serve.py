"""Data-parallel replicas on Ray Serve: each replica one engine behind our OpenAI app.

`minivllm serve MODEL --ray --num-replicas N --replica-cpus C` (or `build_app(...)` for
`serve.run`, or `app_builder` for `serve run minivllm.scale.ray_serve:app_builder model=...`)
deploys N replicas on the Ray cluster that `ray.init()` finds: the one at `RAY_ADDRESS`, one
started on this machine by `ray start`, else a new local one. What Ray does, not us:

- placement: each replica is an actor reserving `num_cpus` (and optionally `memory`); torch
  runs that many threads in it, so replicas on one machine do not fight over cores;
- restarts: the Serve controller replaces a replica whose process dies, and one whose
  `check_health` fails (its engine loop stopped);
- routing: Ray Serve's default request router, power of two choices on queue length. Ray's
  prefix-aware router reads the prompt from deployment-handle arguments, which an HTTP ingress
  does not give it; for prefix-cache affinity run vllm-router over plain servers
  (docs/scale-out.md);
- autoscaling: `autoscaling_config` goes to Serve as it is (its target is ongoing requests
  per replica, i.e. queue length);
- shutdown: on `serve.delete`/SIGTERM a replica stops taking requests, in-flight ones get
  `graceful_shutdown_timeout_s`, then the app's lifespan stops the engine.

Every response names the replica that served it (`x-minivllm-replica`), and /metrics answers
for that replica; each replica's queue and KV gauges also go to Ray's metrics, tagged with
the replica, for a per-replica scrape of every node's metrics export port. Streaming, the
API key and aborts on disconnect are the app's own.
Ray is an optional extra (`pip install 'minivllm[ray]'`): nothing else imports this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

try:
    from ray import serve
except ImportError as exc:  # the optional extra is not installed
    raise ImportError(
        "Ray Serve is not installed: pip install 'minivllm[ray]' (or 'ray[serve]')"
    ) from exc

from minivllm.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from minivllm.server.openai.serving import ChatOptions

logger = logging.getLogger("minivllm.scale")

APP_NAME = "minivllm"
REPLICA_HEADER = "x-minivllm-replica"


@dataclass(frozen=True)
class ReplicaOptions:
    """What each replica builds: its engine (LLMEngine.from_options' keywords) and its app."""

    engine_options: dict[str, Any]
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    chat: ChatOptions = field(default_factory=ChatOptions)
    num_cpus: float = 1.0


class _ReplicaHeader:
    """ASGI middleware: every HTTP response carries `x-minivllm-replica: <replica id>`."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.ingress()
class MinivllmReplica:
    """One replica: an engine stepped by a thread of the replica's process, behind
    `create_app`'s routes (the ASGI app is built by `__serve_build_asgi_app__` once the engine
    is loaded; Serve then runs its lifespan, which starts the engine loop)."""

    def __init__(self, options: ReplicaOptions) -> None:
        import torch

        self.options = options
        # Ray reserves num_cpus for this actor; as many torch threads use them, no more.
        torch.set_num_threads(max(1, int(options.num_cpus)))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.server: Any = None  # the OpenAIServer, once the app is built (`app` is Serve's)

    def __serve_build_asgi_app__(self) -> Any:
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.engine.runtime.cpu_share import share_the_cpu_with_http
        from minivllm.server.app import create_app

        o = self.options
        engine = LLMEngine.from_options(**o.engine_options)
        share_the_cpu_with_http(engine)
        app = create_app(
            engine,
            served_model_name=o.served_model_name,
            api_key=o.api_key,
            max_body_bytes=o.max_body_bytes,
            max_waiting_requests=o.max_waiting_requests,
            chat=o.chat,
        )
        app.add_middleware(_ReplicaHeader, replica=self.replica_id)
        self.server = app.state.server
        _export_engine_gauges(self.server, self.replica_id)
        logger.info("replica %s serving %r", self.replica_id, self.server.served_model_name)
        return app

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine loop stopped is replaced."""
        if self.server is not None and not self.server.engine.is_running:
            raise RuntimeError("the engine loop is not running")


# The engine gauges each replica copies into Ray's metrics, tagged with the replica: every
# node's metrics export port then serves them per replica (`ray_minivllm_<name>`), where the
# proxy's /metrics can only answer for the one replica a scrape happens to reach.
_RAY_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
_RAY_GAUGE_PERIOD_S = 1.0


def _export_engine_gauges(server: Any, replica_id: str) -> None:
    from ray.util.metrics import Gauge

    gauges = {
        name: Gauge(f"minivllm_{name}", f"minivllm:{name} of one replica", tag_keys=("replica",))
        for name in _RAY_GAUGES
    }
    tags = {"replica": replica_id}

    def copy() -> None:
        while True:
            stats = server.engine.stats
            for name, gauge in gauges.items():
                gauge.set(float(stats.get(name, 0)), tags=tags)
            time.sleep(_RAY_GAUGE_PERIOD_S)

    threading.Thread(target=copy, name="minivllm-ray-gauges", daemon=True).start()


def build_app(
    options: ReplicaOptions,
    num_replicas: int = 1,
    memory_bytes: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    graceful_shutdown_s: float = 5.0,
    max_ongoing_requests: int | None = None,
) -> Any:
    """The Serve application: `num_replicas` replicas (or Serve's `autoscaling_config`, as
    Serve takes it, instead), each reserving `options.num_cpus` CPUs and `memory_bytes`."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if options.num_cpus <= 0:
        raise ValueError(f"replica CPUs must be positive, got {options.num_cpus}")
    actor_options: dict[str, Any] = {"num_cpus": options.num_cpus}
    if memory_bytes is not None:
        actor_options["memory"] = memory_bytes
    deployment_options: dict[str, Any] = {
        "name": "MinivllmReplica",
        "ray_actor_options": actor_options,
        "graceful_shutdown_timeout_s": graceful_shutdown_s,
        # Without a cap Serve queues at most 5 requests a replica; the engine batches far more,
        # and its own queue limit answers 503 beyond max_waiting_requests.
        "max_ongoing_requests": max_ongoing_requests or 256,
    }
    if autoscaling_config is not None:
        deployment_options["autoscaling_config"] = autoscaling_config
    else:
        deployment_options["num_replicas"] = num_replicas
    deployment = serve.deployment(MinivllmReplica).options(**deployment_options)
    return deployment.bind(options)


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run minivllm.scale.ray_serve:app_builder model=PATH num_replicas=2
    replica_cpus=1 ...`: the remaining key=value pairs are engine options (as on the CLI)."""
    from dataclasses import fields

    from minivllm.config import EngineConfig

    args = dict(args)
    num_replicas = int(args.pop("num_replicas", 1))
    num_cpus = float(args.pop("replica_cpus", 1))
    api_key = args.pop("api_key", None)
    name = args.pop("served_model_name", None)
    autoscaling = args.pop("autoscaling_config", None)
    types = {f.name: f.type for f in fields(EngineConfig) if f.metadata.get("cli", False)}
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ValueError(f"unknown options {unknown}; engine options are {sorted(types)}")
    engine_options = {k: _parse(v, str(types[k])) for k, v in args.items()}
    options = ReplicaOptions(
        engine_options, served_model_name=name, api_key=api_key, num_cpus=num_cpus
    )
    return build_app(
        options,
        num_replicas=num_replicas,
        autoscaling_config=json.loads(autoscaling) if autoscaling else None,
    )


def _parse(value: str, type_name: str) -> Any:
    if "bool" in type_name:
        return value.lower() in ("1", "true", "yes")
    if "int" in type_name:
        return int(value)
    if "float" in type_name:
        return float(value)
    return value


def serve_on_ray(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """`minivllm serve --ray`: deploy the replicas, serve on `--host:--port` through Ray
    Serve's proxy until SIGINT/SIGTERM, then delete the app gracefully."""
    import ray

    from minivllm.server.serve import chat_options

    if getattr(args, "lab", False):
        raise ValueError("--lab watches one engine of this process; it cannot run with --ray")
    autoscaling = args.autoscaling_config
    if isinstance(autoscaling, str):
        try:
            autoscaling = json.loads(autoscaling)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--autoscaling-config is not valid JSON: {exc}") from None
    options = ReplicaOptions(
        engine_options,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        chat=chat_options(args),
        num_cpus=args.replica_cpus,
    )
    memory = int(args.replica_memory_gb * 2**30) if args.replica_memory_gb else None
    app = build_app(
        options,
        num_replicas=args.num_replicas,
        memory_bytes=memory,
        autoscaling_config=autoscaling,
        graceful_shutdown_s=args.shutdown_timeout,
    )
    # Joins RAY_ADDRESS, or a cluster `ray start` left on this machine, or starts one.
    ray.init(address=os.environ.get("RAY_ADDRESS") or None)
    serve.start(http_options={"host": args.host, "port": args.port})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(
            f"serving on http://{args.host}:{args.port}/v1 with {args.num_replicas} "
            f"replica(s) of {args.replica_cpus} CPU(s) on Ray",
            flush=True,
        )
        stop.wait()
    finally:
        serve.delete(APP_NAME)  # replicas drain their in-flight requests first
        serve.shutdown()
        ray.shutdown()
    return 0
