"""Statuses mapped in one place (server/errors.py): every fault kind the engine reports, every
refusal, and each API's style of them."""

from __future__ import annotations

from scheduler.engine_io import FaultKind, Refusal
from server.errors import (
    ANTHROPIC,
    FAULT_STATUS,
    NATIVE,
    OPENAI,
    REFUSAL_STATUS,
    TRITON,
    fault_status,
    path_style,
    refusal_status,
)


def test_every_fault_kind_has_a_status():
    assert set(FAULT_STATUS) == set(FaultKind)
    assert [fault_status(k) for k in FaultKind] == [503, 400, 500]
    assert fault_status(None) == 503  # an error the engine named no kind for: try again


def test_every_refusal_has_a_status_in_every_style():
    assert set(REFUSAL_STATUS) == set(Refusal)
    assert refusal_status(Refusal.OVERLOADED, NATIVE) == 503
    assert refusal_status(Refusal.OVERLOADED, OPENAI) == refusal_status(Refusal.OVERLOADED, ANTHROPIC) == 429
    assert refusal_status(Refusal.TOO_LONG, OPENAI) == 413


def test_a_path_no_route_declared_for_gets_its_apis_style():
    assert path_style("/v1/messages/count_tokens") is ANTHROPIC
    assert path_style("/v1/nothing") is path_style("/tokenize") is OPENAI
    assert path_style("/v2/models/x/generate") is TRITON
    assert path_style("/models/x/generate") is NATIVE
