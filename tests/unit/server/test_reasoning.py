"""A reasoning model's thinking read apart from its answer (server/reasoning.py): whole and
streamed at every cut alike, answers that open the block themselves (Qwen3) or start inside it
(the R1 distills, whose template opens it: rendered from the real templates), which templates
reason, and hostile answers read in linear time."""

from pathlib import Path

import pytest

from agent.model.chat_template import ChatTemplate
from server import reasoning
from time_limit import deadline

TEMPLATES = Path(__file__).parents[1] / "agent" / "chat_templates"
CHAT = [{"role": "user", "content": "Hi"}]


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def streamed(text: str, inside: bool, cut: int, tags: reasoning.Tags = reasoning.THINK) -> tuple[str, str]:
    splitter = reasoning.ThinkSplitter(inside, tags)
    thought, content = "", ""
    for i in range(0, len(text), cut):
        t, c = splitter.feed(text[i : i + cut])
        thought, content = thought + t, content + c
    t, c = splitter.finish()
    return thought + t, content + c


CASES = [
    # (answer, starts inside, reasoning, content)
    ("<think>\nabc\n</think>\n\nThe answer.", False, "\nabc\n", "The answer."),
    ("  <think>abc</think>answer", False, "abc", "answer"),
    ("abc</think>answer", True, "abc", "answer"),
    ("\nI think.\n</think>\n\nParis.", True, "\nI think.\n", "Paris."),
    ("<think>cut while thinking <", False, "cut while thinking <", ""),
    ("all thinking, no end </thi", True, "all thinking, no end </thi", ""),
    ("Paris is the capital.", False, None, "Paris is the capital."),
    ("  <thin", False, None, "  <thin"),  # a tag's beginning that never finishes is content
    ("a < b and <think>late</think>", False, None, "a < b and <think>late</think>"),
    ("<think></think>Answer", False, "", "Answer"),
    ("x</think>a</think>b", True, "x", "a</think>b"),  # only the first end tag closes
    ("", False, None, ""),
]


@pytest.mark.parametrize(("text", "inside", "thought", "content"), CASES)
def test_whole_answers_split(text, inside, thought, content):
    assert reasoning.Reasoning(inside).split(text) == (thought, content)


@pytest.mark.parametrize(("text", "inside", "thought", "content"), CASES)
@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8])
def test_streamed_answers_split_as_whole_ones_at_every_cut(text, inside, thought, content, cut):
    assert streamed(text, inside, cut) == (thought or "", content)


def in_mistral_tags(text: str | None) -> str | None:
    """A case's text with Magistral's tags for Qwen3's."""
    if text is None:
        return None
    return text.replace("</think>", "[/THINK]").replace("<think>", "[THINK]").replace("</thi", "[/THI")


@pytest.mark.parametrize(("text", "inside", "thought", "content"), CASES)
@pytest.mark.parametrize("cut", [1, 3, 8])
def test_magistral_answers_split_alike(text, inside, thought, content, cut):
    text, thought, content = in_mistral_tags(text), in_mistral_tags(thought), in_mistral_tags(content)
    assert text is not None and content is not None
    assert reasoning.Reasoning(inside, reasoning.MISTRAL).split(text) == (thought, content)
    assert streamed(text, inside, cut, reasoning.MISTRAL) == (thought or "", content)


def test_the_other_formats_tags_are_text():
    assert reasoning.Reasoning(False).split("[THINK]a[/THINK]b") == (None, "[THINK]a[/THINK]b")
    qwen3_style = "<think>a</think>b"
    assert reasoning.Reasoning(False, reasoning.MISTRAL).split(qwen3_style) == (None, qwen3_style)


def test_reasoning_streams_as_it_comes():
    """Only what could be the start of the end tag is held back."""
    splitter = reasoning.ThinkSplitter(inside=True)
    assert splitter.feed("First I") == ("First I", "")
    assert splitter.feed(" think </th") == (" think ", "")
    assert splitter.feed("ink>\n\nYes") == ("", "Yes")
    assert splitter.feed(", Paris.") == ("", ", Paris.")


def test_which_templates_reason():
    qwen3, r1 = template("Qwen-Qwen3-0.6B.jinja"), template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")
    llama = template("meta-llama-Llama-3.1-8B-Instruct.jinja")
    assert reasoning.reasons(qwen3, "auto") and reasoning.reasons(r1, "auto")
    assert not reasoning.reasons(llama, "auto") and not reasoning.reasons(None, "auto")
    assert reasoning.reasons(llama, "think") and not reasoning.reasons(qwen3, "none")
    # Magistral's [THINK] (its system prompt explains the format); Mistral Small 3.2 does not reason
    magistral = template("mistralai-Ministral-3-14B-Reasoning-2512.jinja")
    small = template("Mistral-Small-3.2-24B-Instruct-2506.jinja")
    assert reasoning.tags_of(magistral, "auto") == reasoning.MISTRAL and not reasoning.reasons(small, "auto")
    assert reasoning.tags_of(qwen3, "auto") == reasoning.THINK == reasoning.tags_of(small, "think")
    assert reasoning.tags_of(llama, "mistral") == reasoning.MISTRAL
    assert reasoning.tags_of(magistral, "none") is None


def render(name: str, **kwargs) -> str:
    return ChatTemplate(template(name)).render(CHAT, bos_token="", eos_token="", kwargs=kwargs)


def test_the_prompt_says_whether_the_answer_starts_inside():
    # R1 distills: the generation prompt opens the block
    assert reasoning.opens_inside(render("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")[-40:])
    # Qwen3: the model opens it; with thinking off, the prompt holds an empty (closed) one
    assert not reasoning.opens_inside(render("Qwen-Qwen3-0.6B.jinja")[-40:])
    off = render("Qwen-Qwen3-0.6B.jinja", enable_thinking=False)
    assert "<think>" in off and not reasoning.opens_inside(off[-40:])
    # Magistral: the model opens [THINK]; the system prompt's [THINK]...[/THINK] is text before it
    magistral = render("mistralai-Ministral-3-14B-Reasoning-2512.jinja")
    assert "[THINK]" in magistral and not reasoning.opens_inside(magistral, reasoning.MISTRAL)
    assert reasoning.opens_inside(magistral + "[THINK]\n", reasoning.MISTRAL)


def test_hostile_answers_are_split_in_linear_time():
    with deadline(10):
        for text, inside in [
            (" " * 200_000, False),  # leading whitespace: held only up to a bound
            ("<think>" + "</thin" * 40_000, False),
            ("<" * 200_000, True),
            ("\n" * 100_000 + "<think>x", False),
        ]:
            thought, content = streamed(text, inside, 1)
            assert thought + content in (text, text.lstrip().removeprefix("<think>"))
