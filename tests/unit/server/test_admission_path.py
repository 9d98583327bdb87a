"""One admission path (server/admission.py): every API reaches the engine through admit_answers,
and only that reaches admission.admit, the engine client's generate and the engine's add_request.
Read from the source: a new front end that admits on its own fails here."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[3] / "server"


FUNCTIONS = ast.FunctionDef | ast.AsyncFunctionDef


def own_nodes(fn: ast.AST):
    """The nodes of a function's body, not those of the functions nested in it."""
    for child in ast.iter_child_nodes(fn):
        if not isinstance(child, FUNCTIONS):
            yield child
            yield from own_nodes(child)


def called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def calls(module: str) -> dict[str, set[str]]:
    """Function name -> the names it calls itself (f(...) and x.f(...) alike)."""
    tree = ast.parse((SERVER / module).read_text())
    return {
        fn.name: {called(n) for n in own_nodes(fn) if isinstance(n, ast.Call)}
        for fn in ast.walk(tree)
        if isinstance(fn, FUNCTIONS)
    }


def callers(name: str) -> set[str]:
    return {
        f"{path.name}:{fn}"
        for path in SERVER.glob("*.py")
        for fn, names in calls(path.name).items()
        if name in names
    }


def test_the_engine_is_reached_by_one_call():
    assert callers("add_request") == {"engine_client.py:generate"}
    assert callers("generate") == {"admission.py:generate_answer"}
    assert callers("generate_answer") == {"admission.py:admit"}
    assert callers("admit") == {"admission.py:admit_answers"}


def test_every_api_admits_through_admit_answers():
    assert callers("admit_answers") == {
        "native_api.py:start",  # native
        "triton_api.py:start_answer",  # Triton HTTP, and gRPC below
        "openai_api.py:admit_choices",  # completions and chat, and below
        "pooling_api.py:pooled",  # embeddings, rerank, score: each input one answer
    }
    assert "pooled" in calls("pooling_api.py")["embeddings"]
    assert "pooled" in calls("pooling_api.py")["pair_scores"]
    assert "start_answer" in calls("grpc_server.py")["ModelInfer"]
    assert "start_answer" in calls("grpc_server.py")["_answer_on_stream"]
    assert "admit_chat" in calls("responses_api.py")["create"]
    assert "admit_chat" in calls("anthropic_api.py")["create"]
    assert "admit_choices" in calls("openai_api.py")["admit_chat"]
    assert "admit_choices" in calls("openai_api.py")["completion"]


def test_answers_are_collected_in_one_place():
    """A failed answer becomes the request's error in collect.collected alone."""
    raising = {
        f"{path.name}:{fn.name}"
        for path in SERVER.glob("*.py")
        for fn in ast.walk(ast.parse(path.read_text()))
        if isinstance(fn, FUNCTIONS)
        for node in own_nodes(fn)
        if isinstance(node, ast.Raise) and "error_status" in ast.unparse(node)
    }
    assert raising == {"collect.py:collected"}
