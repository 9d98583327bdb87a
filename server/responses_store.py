"""The responses /v1/responses keeps for `previous_response_id` and GET /v1/responses/{id}: in
memory, each for `server.responses_ttl_s` after it was written, visible only to the client that
created it (its API key, or its address when keys are off). Nothing survives a restart.

Each is held as its encoded JSON (the response as it was answered, and its whole conversation as
chat messages), measured once when it is written: GET answers the bytes as they are, and the
bounds count what the store really holds. The bounds, each in entries and in bytes:

- per client (`responses_client_entries` / `_bytes`): a client beyond its quota loses its own
  least recently used;
- in all (`responses_store_size` / `_bytes`): beyond it the client holding the most (bytes, or
  entries when the count is the bound passed) loses its least recently used, so one client's flood
  never evicts another that holds less;
- per entry (`responses_entry_bytes`): a larger one is not kept at all (`put` says so).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

# What one entry costs beyond its JSON (its id, the objects holding it, the bookkeeping).
ENTRY_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class StoredResponse:
    client: str  # access.client_of of the request that created it
    messages_json: bytes  # the conversation as chat messages, this response's output included
    response_json: bytes  # the response object, as it was answered

    @classmethod
    def encoded(cls, client: str, messages: list[dict], response_json: bytes) -> StoredResponse:
        # ASCII, as the replies: the strings may hold lone surrogates (valid JSON escapes, not UTF-8)
        return cls(client, json.dumps(messages).encode(), response_json)

    @property
    def size(self) -> int:
        return len(self.messages_json) + len(self.response_json) + ENTRY_OVERHEAD_BYTES

    def messages(self) -> list[dict]:
        return json.loads(self.messages_json)


@dataclass(frozen=True)
class StoreBounds:
    entries: int = 1024
    bytes: int = 256 << 20
    entry_bytes: int = 4 << 20
    client_entries: int = 256
    client_bytes: int = 64 << 20

    @classmethod
    def of(cls, server) -> StoreBounds:
        """The bounds server.responses_* set (config/server.py's ServerSection)."""
        return cls(
            server.responses_store_size,
            server.responses_store_bytes,
            server.responses_entry_bytes,
            server.responses_client_entries,
            server.responses_client_bytes,
        )

    def largest_entry(self) -> int:
        """The largest entry kept: none larger fits its client's quota or the store either."""
        if min(self.entries, self.client_entries) == 0:
            return -1
        return min(self.entry_bytes, self.client_bytes, self.bytes)


class ResponseStore:
    def __init__(self, bounds: StoreBounds, ttl_s: float, clock=time.monotonic):
        self.bounds, self.ttl_s, self.clock = bounds, ttl_s, clock
        self._entries: dict[str, StoredResponse] = {}
        self._deadlines: OrderedDict[str, float] = OrderedDict()  # in order of writing: of expiry
        self._used: dict[str, OrderedDict[str, None]] = {}  # client -> its ids, least recent first
        self._client_bytes: dict[str, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keeps the entry unless it is larger than an entry may be; whether it was kept."""
        self._expire()
        if entry.size > self.bounds.largest_entry():
            return False
        if response_id in self._entries:
            self._remove(response_id)
        client = entry.client
        self._entries[response_id] = entry
        self._deadlines[response_id] = self.clock() + self.ttl_s
        self._used.setdefault(client, OrderedDict())[response_id] = None
        self._client_bytes[client] = self._client_bytes.get(client, 0) + entry.size
        self.bytes += entry.size
        bounds, used = self.bounds, self._used[client]
        while len(used) > bounds.client_entries or self._client_bytes[client] > bounds.client_bytes:
            self._remove(next(iter(used)))
        while len(self._entries) > bounds.entries:
            self._remove_oldest_of(max(self._used, key=lambda c: len(self._used[c])))
        while self.bytes > bounds.bytes:
            self._remove_oldest_of(max(self._client_bytes, key=self._client_bytes.__getitem__))
        return response_id in self._entries  # the entry itself goes when its client holds the most

    def get(self, response_id: str, client: str) -> StoredResponse | None:
        """The entry, if it is still held and belongs to `client` (else None: as if it never was)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.client != client:
            return None
        self._used[client].move_to_end(response_id)
        return entry

    def delete(self, response_id: str, client: str) -> bool:
        if self.get(response_id, client) is None:
            return False
        self._remove(response_id)
        return True

    def client_bytes(self, client: str) -> int:
        return self._client_bytes.get(client, 0)

    def _remove_oldest_of(self, client: str) -> None:
        self._remove(next(iter(self._used[client])))

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        del self._deadlines[response_id]
        used = self._used[entry.client]
        del used[response_id]
        self._client_bytes[entry.client] -= entry.size
        self.bytes -= entry.size
        if not used:
            del self._used[entry.client], self._client_bytes[entry.client]

    def _expire(self) -> None:
        now = self.clock()
        while self._deadlines and next(iter(self._deadlines.values())) <= now:
            self._remove(next(iter(self._deadlines)))
