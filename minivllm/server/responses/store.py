"""The Responses API's store: responses kept for GET, DELETE and `previous_response_id`,
in this process's memory (a restart forgets them), bounded in count and bytes, the least
recently used evicted first.

Each entry keeps the response object and the conversation it ends (its input messages and
its output as chat messages), so that a continuation is the same prompt plus the new turn:
the earlier turn's tokens are a prefix of the next prompt, served from the prefix cache.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from minivllm.server.responses.protocol import ResponseObject

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoreOptions:
    """`minivllm serve --response-store-max-responses N --response-store-max-bytes B`, or
    `--no-response-store` (max_responses 0: nothing is kept, `store: true` is ignored)."""

    max_responses: int = DEFAULT_MAX_RESPONSES
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_responses < 0 or self.max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict[str, Any]]  # the conversation up to and including this response
    size: int = 0  # bytes counted against the store's bound


@dataclass
class ResponseStore:
    options: StoreOptions = field(default_factory=StoreOptions)
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.options.max_responses > 0 and self.options.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response: ResponseObject, messages: list[dict[str, Any]]) -> None:
        """Keep (or replace) `response`; evict the least recently used past the bounds. An
        entry larger than the whole byte bound is not kept."""
        if not self.enabled:
            return
        self.delete(response.id)
        size = len(response.model_dump_json()) + len(json.dumps(messages))
        if size > self.options.max_bytes:
            return
        self._entries[response.id] = StoredResponse(response, messages, size)
        self._bytes += size
        while (
            len(self._entries) > self.options.max_responses or self._bytes > self.options.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
