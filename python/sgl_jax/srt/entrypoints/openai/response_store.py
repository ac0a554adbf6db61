"""The in-memory store behind ``/v1/responses``' ``store``, ``previous_response_id`` and ``GET`` / ``DELETE`` /
``cancel`` of ``/v1/responses/{id}``: a pure data structure (no HTTP, no engine), bounded in entries and in time.

OpenAI keeps stored responses for 30 days (https://platform.openai.com/docs/api-reference/responses/create,
``store``); a single inference server keeps them in memory, so this store is bounded both ways:

- at most `max_entries` responses (default `DEFAULT_MAX_ENTRIES`, 1024): storing one more evicts the oldest;
- each for at most `ttl_s` seconds after it was stored (default `DEFAULT_TTL_S`, 3600 s): an older one reads as
  absent (``GET`` answers 404, ``previous_response_id`` 400) and is dropped.

Each entry holds the response object (the JSON-ready dict ``GET`` returns) and the conversation it ends: the
items of its ancestors (``previous_response_id``), its own input items and its output items, which a later
request with ``previous_response_id`` continues. An entry is independent of its ancestors (their eviction does
not break it), at the price of one copy of the conversation per entry; a conversation is bounded by the model's
context. Nothing survives a server restart. All access is from the server's event loop (no locking).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, List, Optional

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    response: the response object as ``GET /v1/responses/{id}`` returns it.
    items: the whole conversation it ends (earlier items, its input items, its output items), as Responses
        items (dicts), in order.
    stored_at: the store's clock (seconds) when it was stored.
    """

    response: dict
    items: List[dict]
    stored_at: float


class ResponseStore:
    """Response id -> `StoredResponse`, bounded by `max_entries` (oldest evicted first) and `ttl_s` (seconds since
    storing; `clock` gives the time, monotonic by default).

    Raises:
        ValueError: from the constructor, `max_entries` < 1 or `ttl_s` <= 0.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: "collections.OrderedDict[str, StoredResponse]" = collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return self.get(response_id) is not None

    def put(self, response_id: str, response: dict, items: List[dict]) -> None:
        """Store `response` (and the conversation `items` it ends) under `response_id`, replacing an entry of that
        id; evicts the oldest entries beyond `max_entries`."""
        self._expire()
        self._entries.pop(response_id, None)
        self._entries[response_id] = StoredResponse(response, list(items), self._clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        """The entry of `response_id`, or None when it was never stored, was deleted, evicted or has expired."""
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Remove `response_id`'s entry; whether there was one (an expired entry counts as none)."""
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop the entries older than `ttl_s` (insertion order is storing order, so they are at the front)."""
        deadline = self._clock() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > deadline:
                break
            self._entries.popitem(last=False)
