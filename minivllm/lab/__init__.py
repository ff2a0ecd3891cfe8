"""The Engine Lab: the chapter-03 experiment (a request's state machine, field by field) live
on the real engine, in the browser. `minivllm lab` serves it; see `app.py` for the JSON API.

The lab sits on top of the engine and imports from it; the engine never imports the lab.
"""

from minivllm.lab.app import create_app, serve_lab

__all__ = ["create_app", "serve_lab"]
