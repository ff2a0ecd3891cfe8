"""The engine's named LoRA adapters: name -> LoRARequest, the ids handed out here.

The `lora_modules` option's adapters get ids 1, 2, ... in order (the runner preloads them with
the same ids); one added later (the server's `POST /v1/load_lora_adapter`) gets the next id, so
an adapter unloaded and loaded again under its name never meets the old one's cached blocks.
Adding only checks the files; the runner reads them into a slot on the first request that
needs them. Pure Python (the file check imports its reader lazily).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from minivllm.config import EngineConfig
from minivllm.lora_request import LoRARequest


@runtime_checkable
class LoRASlots(Protocol):
    """The runner's resident adapters (engine/lora_manager.py's LoRAManager)."""

    def add(self, request: LoRARequest, in_use: Iterable[int] = ()) -> None:
        """Make the adapter resident, evicting one no id in `in_use` needs."""
        ...


class LoRARegistry:
    """Adapters by name. Where the engine runs in a process of its own this is the server's
    side: each request carries the LoRARequest it resolved here, so naming and forgetting
    adapters at run time needs no message to the engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.enabled = config.enable_lora
        self.max_lora_rank = config.max_lora_rank
        self._lock = threading.Lock()  # HTTP threads add, remove and resolve names at once
        self._by_name: dict[str, LoRARequest] = {}
        for i, module in enumerate(config.lora_modules, start=1):
            name, _, path = module.partition("=")
            self._by_name[name] = LoRARequest(name, i, path)
        self._next_id = len(self._by_name) + 1

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def get(self, name: str) -> LoRARequest:
        """The adapter named `name`; ValueError if there is none."""
        with self._lock:
            request = self._by_name.get(name)
        if request is None:
            raise ValueError(f"no LoRA adapter is named {name!r}")
        return request

    def add(self, name: str, path: str) -> LoRARequest:
        """Name the adapter at `path` (its files checked now); ValueError if LoRA is off, the
        name is taken or the files cannot be used."""
        from minivllm.models.lora_files import load_lora

        self._check_enabled()
        if not name or not path:
            raise ValueError("lora_name and lora_path are required")
        if name in self.names():
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        load_lora(path, self.max_lora_rank)
        with self._lock:
            request = LoRARequest(name, self._next_id, path)
            self._by_name[name] = request
            self._next_id += 1
        return request

    def remove(self, name: str) -> None:
        """Forget the adapter named `name` (its slot is reused when another needs one)."""
        self._check_enabled()
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise ValueError(f"no LoRA adapter is named {name!r}")

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ValueError("this server serves no LoRA adapters: start it with --enable-lora")
