"""Stored responses (`store: true`, the default) for GET /v1/responses/{id} and
`previous_response_id`: in memory, least recently used first out, bounded both in count and in
the JSON size of what it holds, so that no client can grow the server's memory without end. A
restart forgets them all."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 128 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]            # the response object, as returned
    conversation: list[dict[str, Any]]  # its input (without instructions) and output, as chat
    size: int                           # messages; what the entry counts against the budget


class ResponseStore:
    """Touched only from the event loop (no awaits inside), so it needs no lock."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, response: dict[str, Any],
            conversation: list[dict[str, Any]]) -> bool:
        """Keep the response, evicting the least recently used ones to make room; False (and
        nothing kept) for one larger than the whole budget."""
        size = len(json.dumps([response, conversation], ensure_ascii=False))
        if size > self.max_bytes or self.max_entries == 0:
            return False
        self.delete(response_id)
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self._bytes + size > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size
        self._entries[response_id] = StoredResponse(response, conversation, size)
        self._bytes += size
        return True

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
