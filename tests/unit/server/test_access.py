"""Who a request's client is, for fair shares: only a key the server checked names one."""

import pytest

from config.schema import ServerSection
from server.access import ApiKeys

ADDRESS = {"path": "/v1/completions", "client": ("127.0.0.5", 40000)}


def bearer(key: str) -> dict:
    return {b"authorization": f"Bearer {key}".encode()}


@pytest.mark.parametrize(
    "keys",
    [{}, {"admin_api_keys": ["admin-key"]}, {"api_keys": ["user-key"], "admin_api_keys": ["admin-key"]}],
    ids=["keys off", "admin keys only", "both"],
)
def test_a_made_up_key_is_the_address_not_a_new_client(keys):
    """With admin keys only, inference is open: a client sending a new random key each time was a
    new client each time (its share and running cap never applied)."""
    api = ApiKeys(ServerSection(**keys))
    named = {api.client(ADDRESS, bearer(f"random-{i}")) for i in range(5)}
    assert named == {"addr:127.0.0.5"}
    assert api.client(ADDRESS, {}) == "addr:127.0.0.5"


def test_a_checked_key_names_its_client_wherever_it_comes_from():
    api = ApiKeys(ServerSection(api_keys=["user-key", "other-key"], admin_api_keys=["admin-key"]))
    elsewhere = {**ADDRESS, "client": ("127.0.0.9", 1)}
    assert api.client(ADDRESS, bearer("user-key")) == api.client(elsewhere, bearer("user-key"))
    assert api.client(ADDRESS, bearer("user-key")).startswith("key:")
    assert api.client(ADDRESS, bearer("user-key")) != api.client(ADDRESS, bearer("other-key"))
    assert api.client(ADDRESS, {b"x-api-key": b"admin-key"}).startswith("key:")


@pytest.mark.parametrize(
    "keys, key, expected",
    [
        ({}, None, None),  # keys off: as open as every path (loopback unless the operator chose otherwise)
        ({"api_keys": ["user-key"]}, "user-key", 403),  # no admin key set: nobody may
        ({"api_keys": ["user-key"]}, None, 401),
        ({"admin_api_keys": ["admin-key"]}, "made-up", 401),
        ({"admin_api_keys": ["admin-key"]}, None, 401),  # admin keys alone: inference open, this not
        ({"api_keys": ["user-key"], "admin_api_keys": ["admin-key"]}, "user-key", 403),
        ({"api_keys": ["user-key"], "admin_api_keys": ["admin-key"]}, "admin-key", None),
    ],
)
def test_dropping_the_prefix_cache_takes_an_admin_key_wherever_keys_are_on(keys, key, expected):
    api = ApiKeys(ServerSection(**keys))
    denied = api.denied({"path": "/reset_prefix_cache"}, {} if key is None else bearer(key))
    assert (denied and denied[0]) == expected, denied
    if expected == 403:
        assert "server.admin_api_keys" in denied[1]
