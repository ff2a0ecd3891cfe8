"""`minivllm serve --model A --model B ...` / `--models-dir DIR`: a server of several models,
each loaded on demand into its own engine process (docs/multi-model.md)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from minivllm.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from minivllm.server.model_registry import ModelRegistry, RegistryLimits, start_engine_process
from minivllm.server.model_specs import model_specs
from minivllm.server.multi_app import create_multi_app
from minivllm.server.multi_lab import LiveModels
from minivllm.server.serve import GracefulServer, _uvicorn_config, chat_options

logger = logging.getLogger("minivllm.server")


def registry_limits(args: argparse.Namespace) -> RegistryLimits:
    """--max-loaded-models, --models-memory-gb, --idle-unload-seconds, --model-load-timeout."""
    memory_gb = getattr(args, "models_memory_gb", None)
    timeout = getattr(args, "model_load_timeout", None)
    return RegistryLimits(
        max_loaded_models=getattr(args, "max_loaded_models", None),
        memory_bytes=None if memory_gb is None else int(memory_gb * 1e9),
        idle_unload_s=getattr(args, "idle_unload_seconds", None),
        load_timeout_s=600.0 if timeout is None else timeout,
    )


def serve_models(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """Serve the models of `args.model` (a list) and `args.models_dir` until SIGINT/SIGTERM."""
    for flag, value in [
        ("--ray", getattr(args, "ray", False)),
        ("--served-model-name", args.served_model_name),
        ("--no-engine-process", not getattr(args, "engine_process", True)),
    ]:
        if value:
            raise SystemExit(f"{flag} serves one model: give one --model")
    try:
        specs = model_specs(list(args.model or []), args.models_dir, engine_options)
        live = LiveModels() if getattr(args, "lab", False) else None
        start = start_engine_process if live is None else live.start
        registry = ModelRegistry(specs, registry_limits(args), start)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    app = create_multi_app(
        registry,
        api_key=args.api_key,
        max_body_bytes=getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
        max_waiting_requests=getattr(args, "max_waiting_requests", None)
        or DEFAULT_MAX_WAITING_REQUESTS,
        chat=chat_options(args),
        allowed_origins=getattr(args, "allowed_origins", None),
        live=live,
    )
    logger.info("serving %s on http://%s:%d/v1", registry.names, args.host, args.port)
    if live is not None:
        logger.info("live Engine Lab on http://%s:%d/lab?model=NAME", args.host, args.port)
    grace = getattr(args, "shutdown_timeout", None) or 5.0
    config = _uvicorn_config(app, grace, host=args.host, port=args.port, log_level="warning")
    GracefulServer(config, grace).run()
    logger.info("server stopped")
    return 0
