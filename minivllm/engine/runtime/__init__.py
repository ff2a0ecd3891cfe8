"""The engine runtime: what drives an `LLMEngine` from above, for the Python API and the
server. `output_processor.py` turns the engine's token outputs into text (detokenizing, stop
strings, logprob texts); `engine_loop.py` steps the engine and applies commands between
steps; `async_engine.py` runs that loop on a thread for asyncio callers, `engine_process.py`
in a process of its own (`engine_core.py` is that process's side, `engine_messages.py` the
typed messages between them); `engine_client.py` is `EngineClient`, the one protocol the
server talks to an engine through; `cpu_share.py` leaves the HTTP thread a core.

The engine core below (scheduler, block manager, runner, `LLMEngine`) never imports it."""
