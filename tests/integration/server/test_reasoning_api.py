"""Chat templates, chat_template_kwargs, tool call formats and reasoning output through a real agent
and `start_server.py`, read with the official `openai` and `anthropic` packages.

The tiny model's weights are random; its tokenizer directory gets a real model's chat template:
Qwen3's (the model opens `<think>` itself; tools as `<tool_call>`; enable_thinking), DeepSeek-R1
Distill's (its prompt opens `<think>`: the answer starts inside) served with
`model.tool_call_parser: llama3_json`, or Ministral 3 Reasoning's (Magistral's
`[THINK]...[/THINK]`, which the tiny vocabulary spells in several tokens; special tokens in
Magistral's own: unit tests). Structured output forces the answers' text: a regex on the
chat API, a JSON Schema `const` on Responses and Messages (whose answer is then a JSON string, its
quote marks included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from agent.model.tokenizer import load_tokenizer
from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from tiny_models import write_tiny_checkpoint

TEMPLATES = Path(__file__).parents[2] / "unit" / "agent" / "chat_templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text(encoding="utf-8")
MAGISTRAL = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text(encoding="utf-8")
MISTRAL_SPECIALS = ("[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")
EOS = "<|im_end|>"  # the tiny vocabulary's
RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 1536, "attend_buckets": [64, 512, 1536]}
QUESTION = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def model_dir(base: Path, tiny: Path, template: str) -> Path:
    """The tiny checkpoint with this chat template in its tokenizer_config.json."""
    directory = base / "model"
    shutil.copytree(tiny, directory)
    config = {"chat_template": template, "bos_token": "<|endoftext|>", "eos_token": EOS}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def stack_of(tmp_path_factory, tiny: Path, template: str, **model):
    base = tmp_path_factory.mktemp("reasoning")
    directory = model_dir(base, tiny, template)
    agent_port, http_port = free_ports(2)
    path = write_config(
        base, directory, [agent_port], runtime=RUNTIME, server={"port": http_port}, model=model
    )
    return directory, path, f"http://127.0.0.1:{http_port}"


def served(tmp_path_factory, tiny: Path, template: str, **model):
    """(the model's directory, the server's URL) while the stack serves (a fixture's body)."""
    directory, path, url = stack_of(tmp_path_factory, tiny, template, **model)
    with serving_stack(path):
        yield directory, url


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_llama_dir):
    yield from served(tmp_path_factory, tiny_llama_dir, QWEN3)


@pytest.fixture(scope="module")
def r1(tmp_path_factory, tiny_llama_dir):
    yield from served(tmp_path_factory, tiny_llama_dir, R1, tool_call_parser="llama3_json")


@pytest.fixture(scope="module")
def magistral(tmp_path_factory, tiny_llama_dir):
    yield from served(tmp_path_factory, tiny_llama_dir, MAGISTRAL)


@pytest.fixture(scope="module")
def magistral_vocabulary(tmp_path_factory):
    """The Magistral template on a tiny model whose vocabulary holds Mistral's markers and think
    tags as special tokens, as Magistral's does: a text decode drops them."""
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-magistral"), seed=3, specials=MISTRAL_SPECIALS)
    yield from served(tmp_path_factory, tiny, MAGISTRAL)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


def forced(regex: str, **body) -> dict:
    return {
        "model": "tiny",
        "temperature": 0,
        "max_tokens": 300,
        "extra_body": {"structured_outputs": {"regex": regex}},
        **body,
    }


def streamed_chat(client: openai.OpenAI, **body) -> tuple[list[tuple[str, str]], list, str | None]:
    """The stream's (field, text) deltas in order, its tool calls, and its finish reason."""
    deltas, calls, reason = [], [], None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                deltas.append(("reasoning", extra["reasoning_content"]))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            calls += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    return deltas, calls, reason


def joined(deltas: list[tuple[str, str]], field: str) -> str:
    return "".join(text for kind, text in deltas if kind == field)


def thinking_tokens(logprobs) -> int:
    """The answer's tokens up to the one that completes `</think>`, from its logprobs' bytes: a
    count independent of the server's (0: the answer does not close a think block)."""
    seen = b""
    for k, entry in enumerate(logprobs.content):
        seen += bytes(entry.bytes or [])
        if b"</think>" in seen:
            return k + 1
    return 0


def reasoning_tokens(usage) -> int:
    return usage.completion_tokens_details.reasoning_tokens


def streamed_usage(client: openai.OpenAI, **body):
    """The stream's final usage chunk's usage."""
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    return chunks[-1].usage


def test_chat_thinking_comes_apart_whole_and_streamed(qwen3):
    client = sdk(qwen3[1])
    body = forced("<think>abc</think>answer", messages=QUESTION)
    reply = client.chat.completions.create(**body, logprobs=True)
    message = reply.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("answer", "abc")
    thought = reasoning_tokens(reply.usage)
    assert thought == thinking_tokens(reply.choices[0].logprobs)
    assert 0 < thought < reply.usage.completion_tokens
    assert reasoning_tokens(streamed_usage(client, **body)) == thought  # greedy: the same answer
    deltas, calls, reason = streamed_chat(client, **body)
    assert joined(deltas, "reasoning") == "abc" and joined(deltas, "content") == "answer"
    kinds = [kind for kind, _ in deltas]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # thinking first
    assert calls == [] and reason == "stop"
    plain_body = forced("plain", messages=QUESTION)
    plain_reply = client.chat.completions.create(**plain_body)
    plain = plain_reply.choices[0].message
    assert plain.content == "plain" and plain.model_extra["reasoning_content"] is None
    assert reasoning_tokens(plain_reply.usage) == 0 and plain_reply.usage.completion_tokens > 0
    assert reasoning_tokens(streamed_usage(client, **plain_body)) == 0


def test_magistral_thinking_comes_apart_and_its_budget_closes_the_block(magistral):
    client = sdk(magistral[1])
    body = forced(r"\[THINK\]abc\[/THINK\]answer", messages=QUESTION)
    reply = client.chat.completions.create(**body)
    message = reply.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("answer", "abc")
    assert 0 < reasoning_tokens(reply.usage) < reply.usage.completion_tokens
    deltas, _, reason = streamed_chat(client, **body)
    assert joined(deltas, "reasoning") == "abc" and joined(deltas, "content") == "answer" and reason == "stop"
    # a budget of 2 tokens: the close tag comes where the grammar lets it, after 2 tokens of thought
    body = forced(r"\[THINK\][a-z]{1,40}\[/THINK\][a-z]{1,8}", messages=QUESTION)
    free = client.chat.completions.create(**body).choices[0].message
    body["extra_body"] |= {"max_thinking_tokens": 2}
    bounded = client.chat.completions.create(**body)
    thought = bounded.choices[0].message.model_extra["reasoning_content"]
    assert 0 < len(thought) < len(free.model_extra["reasoning_content"])
    assert free.model_extra["reasoning_content"].startswith(thought) and bounded.choices[0].message.content


def lark(directory: Path, *parts: str) -> str:
    """A Lark grammar of these parts in order: a special token by its text (MISTRAL_SPECIALS, as
    `<[id]>`: no regex writes one), else a regex."""
    tokenizer = load_tokenizer(directory)

    def part(text: str) -> str:
        if text in MISTRAL_SPECIALS:
            [token] = tokenizer.encode(text, add_special_tokens=False)
            return f"<[{token}]>"
        return "/" + text + "/"

    return "start: " + " ".join(map(part, parts))


def test_control_token_markers_and_tags_are_read_end_to_end(magistral_vocabulary):
    """The model writes [THINK], [/THINK], [TOOL_CALLS] and [ARGS] as the special tokens they are:
    the thinking comes apart, the call is read, whole and streamed, and the budget forces the one
    close token."""
    directory, url = magistral_vocabulary
    client = sdk(url)
    grammar = lark(
        directory,
        "[THINK]",
        "need weather",
        "[/THINK]",
        r"Checking\. ",
        "[TOOL_CALLS]",
        "get_weather",
        "[ARGS]",
        r'\{"city": "Paris"\}',
    )
    body = {
        "model": "tiny",
        "temperature": 0,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "extra_body": {"structured_outputs": {"grammar": grammar}},
    }
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "need weather"
    [found] = choice.message.tool_calls
    assert found.function.name == "get_weather" and json.loads(found.function.arguments) == {"city": "Paris"}
    deltas, calls, reason = streamed_chat(client, **body)
    # streamed, the text before the call goes out as it comes (its space too)
    assert joined(deltas, "reasoning") == "need weather" and joined(deltas, "content") == "Checking. "
    assert reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    # a budget of 2: after [THINK] and 2 tokens of thought the one [/THINK] token is forced
    free_text = {
        "structured_outputs": {"grammar": lark(directory, "[THINK]", "[a-z]{1,40}", "[/THINK]", "[a-z]{1,8}")}
    }
    asked = {"model": "tiny", "temperature": 0, "max_tokens": 60, "messages": QUESTION}
    free = client.chat.completions.create(**asked, extra_body=free_text)
    bounded = client.chat.completions.create(**asked, extra_body=free_text | {"max_thinking_tokens": 2})
    thought = bounded.choices[0].message.model_extra["reasoning_content"]
    assert free.choices[0].message.model_extra["reasoning_content"].startswith(thought)
    assert len(thought) < len(free.choices[0].message.model_extra["reasoning_content"])
    assert reasoning_tokens(bounded.usage) == 4  # [THINK], 2 tokens, [/THINK]
    assert reasoning_tokens(free.usage) > 4


def test_reasoning_tokens_of_every_choice_are_summed(qwen3):
    client = sdk(qwen3[1])
    body = forced("<think>abc</think>answer", messages=QUESTION)
    one = reasoning_tokens(client.chat.completions.create(**body).usage)
    assert reasoning_tokens(client.chat.completions.create(**body, n=3).usage) == 3 * one
    assert reasoning_tokens(streamed_usage(client, **body, n=3)) == 3 * one


def test_a_hermes_call_after_thinking_is_a_tool_call(qwen3):
    client = sdk(qwen3[1])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = forced(
        "<think>need weather</think>" + call.replace("{", r"\{").replace("}", r"\}"),
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "need weather"
    [found] = choice.message.tool_calls
    assert found.function.name == "get_weather" and json.loads(found.function.arguments) == {"city": "Paris"}
    deltas, calls, reason = streamed_chat(client, **body)
    assert joined(deltas, "reasoning") == "need weather" and joined(deltas, "content") == ""
    assert reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]


def reference_tokens(directory: Path, template: str, messages: list[dict], **kwargs) -> int:
    """The prompt's tokens as transformers renders the template (with these kwargs)."""
    rendered, _ = render_jinja_template(
        [messages],
        chat_template=template,
        add_generation_prompt=True,
        bos_token="<|endoftext|>",
        eos_token=EOS,
        **kwargs,
    )
    return len(load_tokenizer(directory).encode(rendered[0], add_special_tokens=False))


def test_chat_template_kwargs_reach_the_template_on_every_api(qwen3):
    directory, url = qwen3
    on = reference_tokens(directory, QWEN3, QUESTION)
    off = reference_tokens(directory, QWEN3, QUESTION, enable_thinking=False)
    assert off > on  # thinking off: an empty think block ends the prompt
    client = sdk(url)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = dict(model="tiny", messages=QUESTION, max_tokens=1, temperature=0)
    assert client.chat.completions.create(**chat).usage.prompt_tokens == on
    assert client.chat.completions.create(**chat, extra_body=kwargs).usage.prompt_tokens == off
    responses = dict(model="tiny", input=QUESTION, max_output_tokens=1, temperature=0)
    assert client.responses.create(**responses, extra_body=kwargs).usage.input_tokens == off
    messages = claude(url).messages
    assert messages.count_tokens(model="tiny", messages=QUESTION).input_tokens == on
    assert messages.count_tokens(model="tiny", messages=QUESTION, extra_body=kwargs).input_tokens == off
    # Anthropic's thinking disabled is Qwen3's enable_thinking false
    disabled = messages.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=1,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert disabled.usage.input_tokens == off


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ([1, 2], "Input should be"),
        ("enable_thinking", "Input should be"),
        ({"messages": []}, "may not set messages"),
        ({"deep": json.loads("[" * 12 + "]" * 12)}, "nests deeper"),
        ({"big": "x" * 20000}, "bytes as JSON"),
    ],
)
def test_bad_chat_template_kwargs_are_a_400_on_every_api(qwen3, kwargs, why):
    url = qwen3[1]
    bodies = {
        "/v1/chat/completions": {"model": "tiny", "messages": QUESTION, "max_tokens": 1},
        "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 1},
        "/v1/messages": {"model": "tiny", "messages": QUESTION, "max_tokens": 1},
    }
    for path, body in bodies.items():
        reply = httpx.post(f"{url}{path}", json={**body, "chat_template_kwargs": kwargs}, timeout=60)
        assert reply.status_code == 400, (path, reply.text)
        assert "chat_template_kwargs" in reply.text and why in reply.text, (path, reply.text)


def const(text: str) -> dict:
    return {"type": "json_schema", "name": "forced", "schema": {"const": text}}


def test_an_r1_answer_starts_inside_its_thinking_and_a_llama3_call_is_read(r1):
    client = sdk(r1[1])
    message = (
        client.chat.completions.create(**forced("abc</think>answer", messages=QUESTION)).choices[0].message
    )
    assert (message.model_extra["reasoning_content"], message.content) == ("abc", "answer")
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    body = forced(
        "ok</think>" + call.replace("{", r"\{").replace("}", r"\}"),
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == "ok"
    [found] = choice.message.tool_calls
    assert found.function.name == "get_weather" and json.loads(found.function.arguments) == {"city": "Paris"}
    deltas, calls, reason = streamed_chat(client, **body)
    assert joined(deltas, "reasoning") == "ok" and joined(deltas, "content") == ""
    assert reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]


def test_responses_give_a_reasoning_item_whole_and_streamed(r1):
    client = sdk(r1[1])
    body = dict(
        model="tiny",
        input="Hello there",
        max_output_tokens=300,
        temperature=0,
        text={"format": const("abc</think>answer")},
        reasoning={"summary": "auto"},
    )
    reply = client.responses.create(**body)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == '"abc' and reply.output_text == 'answer"'
    spent = reply.usage.output_tokens_details.reasoning_tokens
    assert 0 < spent < reply.usage.output_tokens
    assert reply.reasoning.summary == "auto"
    events = list(client.responses.create(stream=True, **body))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == ('"abc', 'answer"')
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message")]
    final = events[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == spent  # greedy: the same answer
    # the response continues its conversation (its reasoning item dropped), and an input that
    # sends a reasoning item back is served
    follow = client.responses.create(
        model="tiny", input="And?", previous_response_id=reply.id, max_output_tokens=2, temperature=0
    )
    assert follow.status in ("completed", "incomplete")
    output = [item.model_dump(exclude_none=True) for item in reply.output]
    echoed = [{"role": "user", "content": "Hello there"}, *output, {"role": "user", "content": "And?"}]
    again = client.responses.create(model="tiny", input=echoed, max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens == follow.usage.input_tokens


def test_a_responses_answer_that_does_not_think_spends_no_reasoning_tokens(qwen3):
    """Qwen3 opens its think block itself: an answer that does not (a JSON string) spends none."""
    client = sdk(qwen3[1])
    body = dict(
        model="tiny",
        input="Hello there",
        max_output_tokens=300,
        temperature=0,
        text={"format": const("plain")},
    )
    usage = client.responses.create(**body).usage
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.output_tokens > 0
    final = list(client.responses.create(stream=True, **body))[-1].response
    assert final.usage.output_tokens_details.reasoning_tokens == 0 and final.output_text == '"plain"'


def test_responses_refuse_reasoning_effort(r1):
    with pytest.raises(openai.BadRequestError, match="reasoning.effort is not supported"):
        sdk(r1[1]).responses.create(model="tiny", input="Hi", reasoning={"effort": "high"})


def test_messages_give_thinking_blocks_whole_and_streamed(r1):
    client = claude(r1[1])
    body = dict(
        model="tiny",
        messages=QUESTION,
        max_tokens=300,
        thinking={"type": "enabled", "budget_tokens": 30},
        extra_body={
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": {"const": "abc</think>answer"}}},
        },
    )
    reply = client.messages.create(**body)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == '"abc' and reply.content[1].text == 'answer"'
    with client.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    thinking = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert thinking == '"abc'
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in reply.content]
    # the assistant's thinking block sent back is dropped, as the template drops past thinking
    history = [*QUESTION, {"role": "assistant", "content": [b.model_dump() for b in reply.content]}]
    history.append({"role": "user", "content": "And?"})
    assert client.messages.count_tokens(model="tiny", messages=history).input_tokens > 0


def test_thinking_is_refused_where_the_model_does_not_reason(tmp_path_factory, tiny_llama_dir):
    """With model.reasoning_parser none the R1 template's model does not reason here."""
    directory, path, url = stack_of(tmp_path_factory, tiny_llama_dir, R1, reasoning_parser="none")
    with serving_stack(path):
        with pytest.raises(anthropic.BadRequestError, match="thinking is not supported"):
            claude(url).messages.create(
                model="tiny",
                messages=QUESTION,
                max_tokens=1,
                thinking={"type": "enabled", "budget_tokens": 1024},
            )
        with pytest.raises(openai.BadRequestError, match="reasoning is not supported"):
            sdk(url).responses.create(model="tiny", input="Hi", reasoning={"summary": "auto"})
        message = (
            sdk(url)
            .chat.completions.create(**forced("abc</think>answer", messages=QUESTION))
            .choices[0]
            .message
        )
        assert message.content == "abc</think>answer" and "reasoning_content" not in (
            message.model_extra or {}
        )
