"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat
path: `protocol.py` (request and response shapes), `convert.py` (a request as the chat
request it means), `output.py` and `stream.py` (the answer, whole or as events), `routes.py`.
"""

from minivllm.server.anthropic.routes import anthropic_routes

__all__ = ["anthropic_routes"]
