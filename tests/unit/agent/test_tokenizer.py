"""Tokenizers from GGUF and tokenizer.json: exact round trips, chat templates, incremental decoding."""

import pytest
from tokenizers import Tokenizer, decoders, models

from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.tokenizer import BYTE_OF_CHAR, TextTokenizer, TokenizerError, load_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "北京是中国的首都。你好，世界！",
    "emoji 😀🎉🚀 and 👩‍👩‍👧",
    "  leading, trailing  \n\n\ttabs and\r\nCRLF  ",
    "digits 0123456789 and 3.14159e-10",
    "mixed: café naïve — «quotes» ß ∑ ∫",
]


@pytest.fixture(scope="module")
def default_tokenizer(default_model_path):
    return load_tokenizer(default_model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    assert default_tokenizer.decode(ids) == text


def test_gguf_digits_are_split_and_specials_are_single_tokens(default_tokenizer):
    assert len(default_tokenizer.encode("12345")) == 5
    assert default_tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert default_tokenizer.eos_ids == (2, 0)  # <|im_end|>, and <|endoftext|> (llama.cpp stops on it)
    assert default_tokenizer.vocab_size == 49152


def test_gguf_chat_template(default_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = default_tokenizer.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(default_tokenizer.encode_chat(messages)) == 37
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    assert "SmolLM" not in default_tokenizer.apply_chat_template(with_system)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_json_round_trip(tiny_llama_dir, text):
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_hf_chat_template_and_eos(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_ids == (tokenizer.tokenizer.token_to_id("<|im_end|>"),)


def test_vocab_mismatch_and_missing_tokenizer(tiny_llama_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_llama_dir)
    with pytest.raises(TokenizerError, match="vocab/weight mismatch"):
        tokenizer.check_fits(tokenizer.vocab_size - 1)
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_pieces_join_to_the_full_text(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    detok = IncrementalDetokenizer(default_tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == default_tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incomplete_character_is_held_back(default_tokenizer):
    ids = default_tokenizer.encode("😀")
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(default_tokenizer)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "😀"


def test_a_character_cut_by_the_end_is_dropped(default_tokenizer):
    ids = default_tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(default_tokenizer)
    pieces = [detok.add(t) for t in ids[:-1]] + [detok.flush()]
    assert "".join(pieces) == detok.text == "ok "


def _byte_level_tokenizer_with_a_replacement_token() -> tuple[TextTokenizer, dict[str, int]]:
    """A byte-level BPE vocabulary: the 256 single bytes, one token for U+FFFD (EF BF BD), one for
    the first two bytes of "€" (E2 82; its last byte AC is a single-byte token), and a special."""
    to_chars = {b: c for c, b in BYTE_OF_CHAR.items()}
    vocab = {c: i for i, c in enumerate(sorted(to_chars.values()))}
    named = {
        "replacement": "".join(to_chars[b] for b in "\ufffd".encode()),
        "euro_head": "".join(to_chars[b] for b in "€".encode()[:2]),
        "euro_tail": to_chars["€".encode()[2]],
        "a": "a",
    }
    for text in named.values():
        vocab.setdefault(text, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end|>"])
    ids = {name: vocab[text] for name, text in named.items()}
    ids["end"] = tokenizer.token_to_id("<|end|>")
    return TextTokenizer(tokenizer, None, None, "<|end|>", (ids["end"],)), ids


@pytest.mark.parametrize(
    "names, pieces",
    [
        (["a", "replacement"], ["a", "\ufffd", ""]),  # a real U+FFFD at the end survives flush
        (["replacement", "replacement"], ["\ufffd", "\ufffd", ""]),  # and is not held back
        (["euro_head", "euro_tail", "replacement"], ["", "€", "\ufffd", ""]),
        (["replacement", "euro_head"], ["\ufffd", "", ""]),  # "€" cut by the end: dropped
        (["a", "end", "replacement"], ["a", "", "\ufffd", ""]),  # a special token adds nothing
    ],
)
def test_a_generated_replacement_character_is_kept(names, pieces):
    tokenizer, ids = _byte_level_tokenizer_with_a_replacement_token()
    detok = IncrementalDetokenizer(tokenizer)
    got = [detok.add(ids[name]) for name in names] + [detok.flush()]
    assert got == pieces and detok.text == "".join(pieces)
