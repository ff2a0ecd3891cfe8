"""OpenAI's Responses API (/v1/responses) over the chat completions machinery: `routes.py`
(the endpoints), `protocol.py` (request and item models), `stream.py` (the output split into
items, streamed), `store.py` (stored responses)."""
