"""llama.cpp's tokenizer suite (tools.fetch_vocab_suite, `make setup-dev`): each vocabulary file
with its texts (.inp) and the ids the family's reference Hugging Face tokenizer gives them (.out),
run through load_tokenizer token for token; then decoding and streaming of the same texts, special
tokens written in a prompt, the tokens that end an answer, and the vocabularies refused.

llama.cpp's own test (tests/test-tokenizer-0.cpp) tokenizes without BOS and without parsing special
tokens; no suite text holds a special token's text, so add_special_tokens=False is the whole match
(a prompt's special tokens: test_special_tokens_written_in_a_prompt_are_single_tokens)."""

from functools import cache
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.gguf_vocab import PRE_TOKENIZERS
from agent.model.tokenizer import TextTokenizer, TokenizerError, load_tokenizer
from tools.fetch_vocab_suite import DEFAULT_DEST, VOCABULARIES

SEPARATOR = "\n__ggml_vocab_test__\n"  # between two texts of a .inp file (test-tokenizer-0.cpp)
LOSSY = {"bert-bge"}  # BERT lowercases and drops spaces: its decode is not the text


@cache
def suite(name: str) -> tuple[TextTokenizer, list[tuple[str, list[int]]]]:
    base = DEFAULT_DEST / f"ggml-vocab-{name}.gguf"
    if not base.is_file():
        pytest.fail(f"{base} is missing: run `make setup-dev` (make test does it first)")
    # as test-tokenizer-0.cpp reads them: a separator at the very end opens no text
    texts = Path(f"{base}.inp").read_text(encoding="utf-8").removesuffix(SEPARATOR).split(SEPARATOR)
    ids = [[int(i) for i in line.split()] for line in Path(f"{base}.out").read_text().splitlines()]
    return load_tokenizer(base), list(zip(texts, ids, strict=True))


@pytest.mark.parametrize("name", VOCABULARIES)
def test_every_text_gives_the_reference_ids(name):
    tokenizer, cases = suite(name)
    wrong = [
        (text, ids, got)
        for text, ids in cases
        if (got := tokenizer.encode(text, add_special_tokens=False)) != ids
    ]
    assert not wrong, f"{name}: {len(cases) - len(wrong)}/{len(cases)} passed; first wrong: {wrong[0]}"


@pytest.mark.parametrize("name", sorted(set(VOCABULARIES) - LOSSY))
def test_every_text_decodes_and_streams_back(name):
    """Pieces streamed token by token join to the text; none shows half a character (U+FFFD)."""
    tokenizer, cases = suite(name)
    for text, ids in cases:
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add(t) for t in ids] + [detok.flush()]
        assert tokenizer.decode(ids) == "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces), text


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "gemma-4"])
def test_a_character_split_across_tokens_is_held_back(name):
    tokenizer, _ = suite(name)
    ids = tokenizer.encode("🪿", add_special_tokens=False)
    assert len(ids) > 1  # the goose's 4 bytes are in several tokens in each of these vocabularies
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in ids] == [""] * (len(ids) - 1) + ["🪿"]


@pytest.mark.parametrize(
    "name, special", [("llama-bpe", "<|eot_id|>"), ("llama-spm", "</s>"), ("qwen2", "<|im_end|>")]
)
def test_a_shown_special_token_is_written_as_its_name(name, special):
    """A tool format's markers stay in the answer's text (Mistral's [TOOL_CALLS] is a control
    token): streamed, the text is the decode that keeps special tokens; without, the plain decode."""
    tokenizer, _ = suite(name)
    [marker] = tokenizer.encode(special, add_special_tokens=False)
    before = tokenizer.encode("Checking: søren 🪿", add_special_tokens=False)
    ids = before + [marker] + tokenizer.encode(' [{"name": "f"}] ok', add_special_tokens=False)
    shown = IncrementalDetokenizer(tokenizer, frozenset({marker}))
    text = "".join(shown.add(t) for t in ids) + shown.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=False) and special + " " in text
    plain = IncrementalDetokenizer(tokenizer)
    assert "".join(plain.add(t) for t in ids) + plain.flush() == tokenizer.decode(ids)


def test_a_user_defined_token_decodes_as_its_text():
    """DeepSeek's vocabulary holds characters such as "ø" as user-defined tokens: text, not the
    byte-level alphabet (read as bytes, "ø" is F8 and "søren" decodes to "s\ufffdren")."""
    tokenizer, _ = suite("deepseek-llm")
    ids = tokenizer.encode("søren", add_special_tokens=False)
    assert 100002 in ids  # "ø"
    detok = IncrementalDetokenizer(tokenizer)
    assert tokenizer.decode(ids) == "".join(detok.add(t) for t in ids) == "søren"


@pytest.mark.parametrize(
    "name, text, ids",
    [
        (
            "llama-bpe",
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
            [128006, 882, 128007, 271, 13347, 128009],
        ),
        ("qwen2", "<|im_start|>user\nHi<|im_end|>\n", [151644, 872, 198, 13048, 151645, 198]),
        ("gemma-4", "<|tool_call>x<tool_call|>", [48, 236781, 49]),  # user-defined tokens, whole too
    ],
)
def test_special_tokens_written_in_a_prompt_are_single_tokens(name, text, ids):
    """A chat template writes control tokens as text; each becomes its one id (llama-server parses
    special tokens in a prompt the same way)."""
    tokenizer, _ = suite(name)
    assert tokenizer.encode(text, add_special_tokens=False) == ids


@pytest.mark.parametrize(
    "name, ends",
    [
        ("llama-bpe", {128001, 128009}),  # <|end_of_text|>, <|eot_id|>
        ("qwen2", {151643, 151645}),  # <|endoftext|>, <|im_end|>
        ("qwen35", {151643, 151645}),
        ("phi-3", {32000, 32007}),  # <|endoftext|>, <|end|>
        ("deepseek-llm", {100001}),  # <｜end▁of▁sentence｜>
        ("command-r", {255001}),  # <|END_OF_TURN_TOKEN|>
    ],
)
def test_the_end_of_a_turn_ends_an_answer(name, ends):
    """Each family's end-of-turn token is among the ids that stop an answer, whichever one the file
    names as EOS (Llama 3's names <|end_of_text|>; its chat turns end in <|eot_id|>)."""
    tokenizer, _ = suite(name)
    assert set(tokenizer.eos_ids) == ends


def test_llama3_adds_bos_where_the_file_does_not_say():
    """Llama 3's files may lack add_bos_token; llama.cpp and the reference add <|begin_of_text|>."""
    tokenizer, _ = suite("llama-bpe")
    assert tokenizer.encode("Hello") == [128000, 9906]


def test_qwen2_composes_characters_first():
    """Qwen 2's tokenizer.json normalizes to NFC (transformers' Qwen2Converter); Qwen 3.5's does not
    (its suite texts hold decomposed characters)."""
    qwen2, _ = suite("qwen2")
    assert qwen2.encode("cafe\u0301", add_special_tokens=False) == [924, 58858]  # as "café"
    qwen35, _ = suite("qwen35")
    assert qwen35.encode("e\u0301", add_special_tokens=False) == [68, 53839]


def _split(pre: str, text: str) -> list[str]:
    steps = PRE_TOKENIZERS[pre].steps()
    return [piece for piece, _ in pre_tokenizers.Sequence(steps[:-1]).pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt-4o", ["Hello", "World", " ", "123", "45", " don't", "\n\n"]),  # digits by three
        ("tekken", ["Hello", "World", " ", "1", "2", "3", "4", "5", " don", "'t", "\n\n"]),
        ("smaug-bpe", ["HelloWorld", " ", "123", "45", " don", "'t", "\n\n"]),  # Llama 3's split
    ],
)
def test_pre_tokenizers_the_suite_lacks(pre, pieces):
    """Phi-4's (gpt-4o), Mistral Nemo's (tekken) and Smaug's splits, as their tokenizer.json regexes
    define them (no reference ids for these: the splits here are read off the regexes by hand)."""
    assert _split(pre, "HelloWorld 12345 don't\n\n") == pieces


def _vocabulary_file(path: Path, model: str, pre: str | None) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "model, pre, named",
    [
        ("gpt2", "chatglm-bpe", "pre-tokenizer 'chatglm-bpe' is not supported"),
        ("gpt2", "seed-coder", "pre-tokenizer 'seed-coder' is not supported"),
        ("rwkv", None, "tokenizer model 'rwkv' is not supported"),
    ],
)
def test_a_vocabulary_not_reproduced_exactly_is_refused(tmp_path, model, pre, named):
    path = _vocabulary_file(tmp_path / "vocab.gguf", model, pre)
    with pytest.raises(TokenizerError, match=named) as refused:
        load_tokenizer(path)
    assert str(path) in str(refused.value)
