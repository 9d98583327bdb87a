"""The responses /v1/responses keeps for `previous_response_id` and GET /v1/responses/{id}: in
memory, at most `server.responses_store_size` of them (the least recently used go first), each for
`server.responses_ttl_s` after it was written. Each holds its whole conversation (chat messages,
the response's own output last) and is visible only to the client that created it (its API key,
or its address when keys are off). Nothing survives a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    client: str  # access.client_of of the request that created it
    messages: list[dict]  # the conversation as chat messages, this response's output included
    response: dict  # the response object, as it was answered


class ResponseStore:
    def __init__(self, size: int, ttl_s: float, clock=time.monotonic):
        self.size, self.ttl_s, self.clock = size, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._deadlines: OrderedDict[str, float] = OrderedDict()  # in order of writing: of expiry

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._expire()
        self._entries[response_id] = entry
        self._deadlines[response_id] = self.clock() + self.ttl_s
        while len(self._entries) > self.size:
            oldest, _ = self._entries.popitem(last=False)
            del self._deadlines[oldest]

    def get(self, response_id: str, client: str) -> StoredResponse | None:
        """The entry, if it is still held and belongs to `client` (else None: as if it never was)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.client != client:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, client: str) -> bool:
        if self.get(response_id, client) is None:
            return False
        del self._entries[response_id], self._deadlines[response_id]
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._deadlines and next(iter(self._deadlines.values())) <= now:
            oldest, _ = self._deadlines.popitem(last=False)
            del self._entries[oldest]
