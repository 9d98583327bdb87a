"""The answer tokens a reasoning model spends thinking (server/reasoning.py's ThinkCounter, usage's
reasoning_tokens), on a real tokenizer's ids fed as the engine hands them out (one or several at a
time), against a brute-force reference: the shortest prefix of the ids whose decode closes the block."""

import pytest
from tokenizers import AddedToken

from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.tokenizer import TextTokenizer, load_tokenizer
from server import reasoning
from time_limit import deadline


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def reference(tokenizer, ids: list[int], inside: bool) -> int:
    """Tokens up to the one whose decode completes `</think>`; all of them where the block is never
    closed; none where the answer does not open one."""
    whole = tokenizer.decode(ids)
    if not inside and not whole.lstrip().startswith("<think>"):
        return 0
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        opened = 0 if inside else text.find("<think>") + len("<think>")
        if "</think>" in text[opened:]:
            return k
    return len(ids)


def counted(tokenizer, ids: list[int], inside: bool, step: int) -> int:
    counter = reasoning.Reasoning(inside).counter(tokenizer)
    for i in range(0, len(ids), step):
        counter.feed(ids[i : i + step])
    return counter.tokens


@pytest.mark.parametrize(
    ("text", "inside"),
    [
        ("<think>abc def</think>The answer is 4.", False),
        ("  \n<think>\nlet me see</think>\n\nok", False),
        ("<think></think>ok", False),
        ("<think>never closed, cut while thinking", False),
        ("No thinking here. </think> <think>", False),
        ("abc</think>answer", True),  # R1: the prompt opened the block
        ("</think>answer", True),
        ("thinking <thin and </thin and still", True),
        ("héllo wörld 🙂 </think> ✓", True),
    ],
)
@pytest.mark.parametrize("step", [1, 2, 3, 100])
def test_the_tokens_spent_thinking_are_those_up_to_the_end_tag(tokenizer, text, inside, step):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = reference(tokenizer, ids, inside)
    assert counted(tokenizer, ids, inside, step) == expected
    if "</think>" in text and (inside or text.lstrip().startswith("<think>")):
        assert 0 < expected < len(ids) or text.endswith("</think>")


def test_a_long_answer_is_counted_in_linear_time(tokenizer):
    ids = tokenizer.encode("<think>" + "ab <thi </thin " * 20_000 + "</think>done", add_special_tokens=False)
    with deadline(10):
        spent = counted(tokenizer, ids, inside=False, step=1)
    assert spent == len(ids) - len(tokenizer.encode("done", add_special_tokens=False))


def test_magistral_tags_as_special_tokens_are_read_and_counted(tiny_llama_dir):
    """Magistral's vocabulary holds [THINK] and [/THINK] as control tokens, which a text decode
    drops: of_answers keeps them shown, so the block is seen, split and counted."""
    inner = load_tokenizer(tiny_llama_dir).tokenizer
    inner.add_special_tokens([AddedToken(tag, special=True) for tag in ("[THINK]", "[/THINK]")])
    template = "{{ messages[0]['content'] }} [THINK]How to think[/THINK] is explained"
    vocab = TextTokenizer(inner, template, None, None, ())
    prompt = vocab.encode("[INST]Hi[/INST]", add_special_tokens=False)
    found = reasoning.of_answers(vocab, "auto", prompt)
    assert found is not None and found.tags == reasoning.MISTRAL and not found.inside
    think, close = (vocab.encode(tag, add_special_tokens=False) for tag in ("[THINK]", "[/THINK]"))
    assert len(think) == len(close) == 1 and found.shown == {think[0], close[0]}
    thinking, answer = (vocab.encode(text, add_special_tokens=False) for text in ("let me see", "Paris"))
    ids = think + thinking + close + answer
    counter = found.counter(vocab)
    counter.feed(ids)
    assert counter.tokens == 1 + len(thinking) + 1
    detokenizer = IncrementalDetokenizer(vocab, found.shown)
    text = "".join(detokenizer.add(token) for token in ids)
    assert found.split(text) == ("let me see", "Paris")
    unshown = reasoning.Reasoning(False, reasoning.MISTRAL).counter(vocab)  # the tags dropped: no block
    unshown.feed(ids)
    assert unshown.tokens == 0
