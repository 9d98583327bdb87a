"""The prefix-cache salt a request's blocks chain from (server/admission.py tenant_salt): with keys
on, each verified key's own (vLLM's per-tenant salt), so that no tenant reads from its time to first
token what another sent; server.prefix_cache_per_key false keeps one cache for all."""

import pytest

from server.access import KEY_CLIENT
from server.admission import tenant_salt

KEY_A, KEY_B = KEY_CLIENT + "a" * 16, KEY_CLIENT + "b" * 16


def test_each_key_salts_its_own_blocks_and_a_request_salt_adds_to_it():
    assert tenant_salt(KEY_A, None, True) != tenant_salt(KEY_B, None, True)
    assert tenant_salt(KEY_A, None, True) == tenant_salt(KEY_A, None, True)
    others = (tenant_salt(KEY_A, None, True), tenant_salt(KEY_B, "x", True), "x")
    assert tenant_salt(KEY_A, "x", True) not in others


def test_without_keys_or_per_key_salts_the_request_salt_stands_alone():
    assert tenant_salt("addr:127.0.0.1", None, True) is None  # no verified identity: the common cache
    assert tenant_salt("addr:127.0.0.1", "x", True) == "x"
    assert tenant_salt(KEY_A, None, False) is None  # one cache for every key, as configured
    assert tenant_salt(KEY_A, "x", False) == "x"


def test_a_salt_that_is_not_text_is_refused_by_every_schema():
    """A lone surrogate in cache_salt (were a body parser to let one through) is refused where the
    request is validated, naming the field: pydantic's str takes only text."""
    from pydantic import ValidationError

    from server.anthropic_schema import MessagesRequest
    from server.native_schema import Parameters
    from server.openai_schema import CompletionRequest
    from server.responses_schema import ResponsesRequest

    bodies = [
        (CompletionRequest, {"model": "m", "prompt": "hi"}),
        (MessagesRequest, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
        (ResponsesRequest, {"model": "m", "input": "hi"}),
        (Parameters, {}),
    ]
    for schema, body in bodies:
        schema.model_validate({**body, "cache_salt": "tenant-a"})
        with pytest.raises(ValidationError, match="cache_salt\n  Input should be a valid string"):
            schema.model_validate({**body, "cache_salt": "tenant-\ud800"})
