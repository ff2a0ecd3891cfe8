"""The engine runtime: what drives an `LLMEngine` for a server, between the HTTP side and the
engine core. `engine_loop.py` steps the engine and applies commands between steps;
`async_engine.py` runs that loop on a thread for asyncio callers, `engine_process.py` in a
process of its own (`engine_core.py` is that process's side, `engine_messages.py` the typed
messages between them); `engine_client.py` is `EngineClient`, the one protocol the server
talks to an engine through."""
