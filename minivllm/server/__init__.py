"""The OpenAI-compatible server: an async engine loop, FastAPI routes, Prometheus metrics."""

from minivllm.server.app import create_app
from minivllm.server.async_engine import AsyncLLMEngine
from minivllm.server.serve import ServerThread, run_server, serve

__all__ = ["AsyncLLMEngine", "ServerThread", "create_app", "run_server", "serve"]
