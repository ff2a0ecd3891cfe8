"""The HTTP server: FastAPI routes for the OpenAI, Responses and Anthropic APIs, Prometheus
metrics; it drives the engine through the runtime (`minivllm.engine.runtime`)."""

from minivllm.server.app import create_app
from minivllm.server.serve import ServerThread, run_server, serve

__all__ = ["ServerThread", "create_app", "run_server", "serve"]
