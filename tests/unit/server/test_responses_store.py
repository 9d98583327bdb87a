"""The store behind previous_response_id: bounded in entries and in bytes, in all and per client
(least recently used dropped, a flood evicting only its own client's), refusing an entry larger
than one may be, expiring, and private to the client that wrote each response."""

import json

from server.responses_store import ENTRY_OVERHEAD_BYTES, ResponseStore, StoreBounds, StoredResponse

A, B = "key:a", "key:b"
ROOMY = StoreBounds(entries=64, bytes=1 << 20, entry_bytes=1 << 20, client_entries=64, client_bytes=1 << 20)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(client: str = A, padding: int = 0) -> StoredResponse:
    response = json.dumps({"id": "x", "metadata": {"pad": "p" * padding}}).encode()
    return StoredResponse.encoded(client, [{"role": "user", "content": "hi"}], response)


def store_of(clock=None, **bounds) -> ResponseStore:
    return ResponseStore(StoreBounds(**{**ROOMY.__dict__, **bounds}), 60, clock or Clock())


def test_the_least_recently_used_go_first_beyond_the_size():
    store = store_of(entries=2)
    store.put("r1", entry())
    store.put("r2", entry())
    assert store.get("r1", A) is not None  # r1 used: r2 is now the least recent
    store.put("r3", entry())
    assert len(store) == 2 and store.get("r2", A) is None
    assert store.get("r1", A) is not None and store.get("r3", A) is not None


def test_an_entry_is_its_encoded_json_measured_once():
    kept = entry(padding=1000)
    assert kept.size == len(kept.response_json) + len(kept.messages_json) + ENTRY_OVERHEAD_BYTES
    assert json.loads(kept.response_json)["metadata"]["pad"] == "p" * 1000
    assert kept.messages() == [{"role": "user", "content": "hi"}]


def test_entries_beyond_the_bytes_bound_go_least_recently_used_first():
    size = entry(padding=1000).size
    store = store_of(bytes=3 * size)
    for n in range(5):
        assert store.put(f"r{n}", entry(padding=1000))
        assert store.bytes <= 3 * size
    assert [store.get(f"r{n}", A) is not None for n in range(5)] == [False, False, True, True, True]


def test_an_entry_larger_than_one_may_be_is_not_kept_and_evicts_nothing():
    small = entry()
    store = store_of(entry_bytes=small.size + 100)
    assert store.put("small", small)
    assert not store.put("large", entry(padding=200))
    assert store.get("large", A) is None and store.get("small", A) is not None
    assert store.bytes == small.size


def test_an_entry_larger_than_a_clients_quota_or_the_store_is_not_kept():
    size = entry(padding=1000).size
    assert not store_of(client_bytes=size - 1).put("r", entry(padding=1000))
    assert not store_of(bytes=size - 1).put("r", entry(padding=1000))
    assert store_of(bytes=size, client_bytes=size).put("r", entry(padding=1000))


def test_a_client_beyond_its_quota_loses_only_its_own_entries():
    size = entry(padding=1000).size
    for bounds in ({"client_entries": 3}, {"client_bytes": 3 * size}):
        store = store_of(**bounds)
        assert store.put("b", entry(B, padding=1000))
        for n in range(50):
            assert store.put(f"a{n}", entry(A, padding=1000))
        assert store.get("b", B) is not None
        assert [store.get(f"a{n}", A) is not None for n in range(47, 50)] == [True] * 3
        assert len(store) == 4 and store.client_bytes(A) == 3 * size


def test_a_full_store_evicts_the_client_holding_the_most_not_the_least_recent():
    """B wrote first and holds less: A's flood past the store's bounds evicts A's own entries."""
    size = entry(padding=1000).size
    for bounds in ({"entries": 4}, {"bytes": 4 * size}):
        store = store_of(**bounds)
        store.put("b1", entry(B, padding=1000))
        store.put("b2", entry(B, padding=1000))
        for n in range(100):
            store.put(f"a{n}", entry(A, padding=1000))
        assert store.get("b1", B) is not None and store.get("b2", B) is not None
        assert store.get("a99", A) is not None and store.get("a98", A) is not None
        assert len(store) == 4


def test_entries_expire_after_their_lifetime_even_when_used():
    clock = Clock()
    store = store_of(clock)
    store.put("r1", entry())
    clock.now = 5
    store.put("r2", entry())
    assert store.get("r1", A) is not None
    clock.now = 60
    assert store.get("r1", A) is None and store.get("r2", A) is not None
    clock.now = 65
    assert len(store) == 0 and store.bytes == 0 and store.client_bytes(A) == 0


def test_another_client_neither_sees_nor_deletes_an_entry():
    store = store_of()
    store.put("r1", entry(A))
    assert store.get("r1", B) is None and not store.delete("r1", B)
    assert store.delete("r1", A) and store.get("r1", A) is None
    assert store.bytes == 0


def test_size_zero_keeps_nothing():
    store = store_of(entries=0)
    assert not store.put("r1", entry())
    assert store.get("r1", A) is None
