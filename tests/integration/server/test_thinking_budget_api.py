"""A reasoning model's thinking budget (server/thinking_budget.py) through a real agent and
`start_server.py`: chat `max_thinking_tokens`, Responses `reasoning.max_tokens`, Messages
`thinking.budget_tokens`, read with the official `openai` and `anthropic` packages.

The tiny model (random weights) gets DeepSeek-R1 Distill's chat template, whose prompt opens
`<think>`: its answer starts inside the block and never closes it on its own, so the budget is what
closes it. Its vocabulary spells `</think>` in 8 tokens, forced in order. The chat answer's
logprobs show its tokens one by one: the reference the other APIs' answers are held to. The
stack speculates (n-gram): a constrained answer proposes nothing, and equals its answer without
speculation."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_reasoning_api import QUESTION, QWEN3, R1, RUNTIME, claude, joined, model_dir, sdk, streamed_chat
from test_speculation import SPECULATION  # proposals of a fixed length (why: there)

from agent_harness import free_ports, serving_stack, write_config

TAG = "</think>"
PROPOSED = "llm_serving_spec_proposed_tokens_total"
BUDGET, LENGTH = 6, 40


def stack(tmp_path_factory, tiny, template: str = R1, **model):
    base = tmp_path_factory.mktemp("thinking-budget")
    directory = model_dir(base, tiny, template)
    agent_port, http_port = free_ports(2)
    runtime = {**RUNTIME, "speculation": SPECULATION}
    path = write_config(
        base, directory, [agent_port], runtime=runtime, server={"port": http_port}, model=model
    )
    return directory, path, f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def r1(tmp_path_factory, tiny_llama_dir):
    directory, path, url = stack(tmp_path_factory, tiny_llama_dir)
    with serving_stack(path):
        yield directory, url


def chat(budget: int | None, **body) -> dict:
    extra = {} if budget is None else {"max_thinking_tokens": budget}
    return {
        "model": "tiny",
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": LENGTH,
        **body,
        "extra_body": extra | body.get("extra_body", {}),
    }


def tokens_of(choice) -> list[bytes]:
    return [bytes(t.bytes) for t in choice.logprobs.content]


def text(tokens: list[bytes]) -> str:
    """Tokens' text (a character may span tokens: joined as bytes first)."""
    return b"".join(tokens).decode("utf-8", "replace")


@pytest.mark.parametrize("budget", [0, 1, BUDGET])
def test_chat_thinks_at_most_the_budget_then_the_tag_then_answers(r1, budget):
    client = sdk(r1[1])
    free = client.chat.completions.create(**chat(None, logprobs=True)).choices[0]
    assert TAG not in text(tokens_of(free))  # unbounded, this model never closes the block
    choice = client.chat.completions.create(**chat(budget, logprobs=True)).choices[0]
    tokens = tokens_of(choice)
    # the budget's tokens are the unbounded answer's, then the tag, forced
    assert tokens[:budget] == tokens_of(free)[:budget]
    assert text(tokens[budget : budget + len(TAG)]) == TAG
    message = choice.message
    assert message.model_extra["reasoning_content"] == text(tokens[:budget])
    # (the answer's last bytes may be part of a character, shown or not as U+FFFD)
    after = text(tokens[budget + len(TAG) :]).lstrip()
    assert message.content and message.content.rstrip("\ufffd") == after.rstrip("\ufffd")
    assert choice.finish_reason == "length" and len(tokens) == LENGTH
    deltas, _, reason = streamed_chat(client, **chat(budget))
    assert joined(deltas, "reasoning") == text(tokens[:budget])
    assert joined(deltas, "content") == message.content and reason == "length"
    # speculation: the same answer without it
    unspeculated = client.chat.completions.create(**chat(budget, extra_body={"speculate": False}))
    assert unspeculated.choices[0].message.content == message.content


def proposed(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == PROPOSED)


def test_proposals_go_on_before_the_budget_is_spent_and_change_no_answer(r1):
    """A budget's free tokens are proposed (n-gram lookup on a prompt that repeats itself); the
    tag still comes right after the budget, and the answer is the one without speculation. The
    answer ends with the tag, so every proposal counted was made while thinking."""
    client, budget = sdk(r1[1]), 24
    body = chat(
        budget,
        messages=[{"role": "user", "content": "one two three four, one two three four, one two three"}],
        max_tokens=budget + len(TAG),
        logprobs=True,
    )
    before = proposed(r1[1])
    tokens = tokens_of(client.chat.completions.create(**body).choices[0])
    assert proposed(r1[1]) > before, "nothing was proposed"
    assert len(tokens) == budget + len(TAG) and text(tokens[budget:]) == TAG
    plain = client.chat.completions.create(**body | {"extra_body": body["extra_body"] | {"speculate": False}})
    assert tokens_of(plain.choices[0]) == tokens


def test_a_grammar_decides_the_text_and_the_tag_comes_where_it_allows(r1):
    client = sdk(r1[1])
    body = chat(2, extra_body={"structured_outputs": {"regex": "[a-z]{4,}</think>answer"}})
    message = client.chat.completions.create(**body).choices[0].message
    # the budget spent after 2 letters, the grammar wants 4: the tag comes right after the 4th
    assert len(message.model_extra["reasoning_content"]) == 4 and message.content == "answer"


def reference(url: str, budget: int) -> tuple[str, str]:
    """The chat answer's (reasoning, content), its tag where the budget puts it."""
    choice = sdk(url).chat.completions.create(**chat(budget, logprobs=True)).choices[0]
    assert text(tokens_of(choice)[budget : budget + len(TAG)]) == TAG
    return choice.message.model_extra["reasoning_content"], choice.message.content


def test_responses_reasoning_max_tokens_bounds_the_reasoning_item(r1):
    url = r1[1]
    thought, content = reference(url, BUDGET)
    client = sdk(url)
    body = dict(
        model="tiny",
        input="Hello there",
        max_output_tokens=LENGTH,
        temperature=0,
        reasoning={"max_tokens": BUDGET},
    )
    reply = client.responses.create(**body)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert (reply.output[0].content[0].text, reply.output_text) == (thought, content)
    events = list(client.responses.create(stream=True, **body))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed, text) == (thought, content)


def test_messages_enforce_budget_tokens(r1):
    url = r1[1]
    thought, content = reference(url, BUDGET)
    client = claude(url)
    body = dict(
        model="tiny",
        messages=QUESTION,
        max_tokens=LENGTH,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0},
    )
    reply = client.messages.create(**body)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert (reply.content[0].thinking, reply.content[1].text) == (thought, content)
    with client.messages.stream(**body) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert "".join(d.text for d in deltas if d.type == "text_delta") == content


@pytest.mark.parametrize(
    ("budget", "why"),
    [(-1, "greater than or equal to 0"), (1.5, "integer"), ("x", "integer"), (LENGTH + 1, "more than")],
)
def test_a_bad_budget_is_a_400_named_as_each_api_names_it(r1, budget, why):
    url = r1[1]
    bodies = {
        "/v1/chat/completions": (
            {"model": "tiny", "messages": QUESTION, "max_tokens": LENGTH, "max_thinking_tokens": budget},
            "max_thinking_tokens",
        ),
        "/v1/responses": (
            {
                "model": "tiny",
                "input": "Hi",
                "max_output_tokens": LENGTH,
                "reasoning": {"max_tokens": budget},
            },
            "reasoning.max_tokens",
        ),
        "/v1/messages": (
            {
                "model": "tiny",
                "messages": QUESTION,
                "max_tokens": LENGTH,
                "thinking": {"type": "enabled", "budget_tokens": budget},
            },
            "thinking.budget_tokens",
        ),
    }
    for path, (body, name) in bodies.items():
        reply = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert reply.status_code == 400, (path, reply.text)
        assert name in reply.text and why in reply.text, (path, reply.text)


def test_a_budget_on_a_model_that_does_not_reason_is_a_400(tmp_path_factory, tiny_llama_dir):
    _, path, url = stack(tmp_path_factory, tiny_llama_dir, reasoning_parser="none")
    with serving_stack(path):
        with pytest.raises(openai.BadRequestError, match="max_thinking_tokens: this model does not reason"):
            sdk(url).chat.completions.create(**chat(2))
        with pytest.raises(openai.BadRequestError, match="reasoning is not supported"):
            sdk(url).responses.create(model="tiny", input="Hi", reasoning={"max_tokens": 2})


def test_an_answer_that_opens_the_block_itself_is_counted_from_its_open_tag(tmp_path_factory, tiny_llama_dir):
    """Qwen3's template: the answer writes `<think>` itself (here as a grammar has it write it)."""
    _, path, url = stack(tmp_path_factory, tiny_llama_dir, QWEN3)
    with serving_stack(path):
        body = chat(2, extra_body={"structured_outputs": {"regex": "<think>[a-z]{4,}</think>answer"}})
        message = sdk(url).chat.completions.create(**body).choices[0].message
        assert len(message.model_extra["reasoning_content"]) == 4 and message.content == "answer"
        # thinking off (an empty block in the prompt) and not opened: the budget changes nothing
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        bounded = sdk(url).chat.completions.create(**chat(0, extra_body=off)).choices[0].message
        free = sdk(url).chat.completions.create(**chat(None, extra_body=off)).choices[0].message
        assert bounded.content and bounded.content == free.content
