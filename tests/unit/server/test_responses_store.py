"""The store behind previous_response_id: bounded (least recently used dropped), expiring, and
private to the client that wrote each response."""

from server.responses_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(client: str = "key:a") -> StoredResponse:
    return StoredResponse(client, [{"role": "user", "content": "hi"}], {"id": "x"})


def test_the_least_recently_used_go_first_beyond_the_size():
    store = ResponseStore(2, 60, Clock())
    store.put("r1", entry())
    store.put("r2", entry())
    assert store.get("r1", "key:a") is not None  # r1 used: r2 is now the least recent
    store.put("r3", entry())
    assert len(store) == 2 and store.get("r2", "key:a") is None
    assert store.get("r1", "key:a") is not None and store.get("r3", "key:a") is not None


def test_entries_expire_after_their_lifetime_even_when_used():
    clock = Clock()
    store = ResponseStore(8, 10, clock)
    store.put("r1", entry())
    clock.now = 5
    store.put("r2", entry())
    assert store.get("r1", "key:a") is not None
    clock.now = 10
    assert store.get("r1", "key:a") is None and store.get("r2", "key:a") is not None
    clock.now = 15
    assert len(store) == 0


def test_another_client_neither_sees_nor_deletes_an_entry():
    store = ResponseStore(8, 60, Clock())
    store.put("r1", entry("key:a"))
    assert store.get("r1", "key:b") is None and not store.delete("r1", "key:b")
    assert store.delete("r1", "key:a") and store.get("r1", "key:a") is None


def test_size_zero_keeps_nothing():
    store = ResponseStore(0, 60, Clock())
    store.put("r1", entry())
    assert store.get("r1", "key:a") is None
