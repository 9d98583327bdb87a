"""SentencePiece vocabularies from GGUF (`tokenizer.ggml.model: llama`): Gemma 3's, built into a
`tokenizers` BPE model (agent/model/tokenizer.py), against two references.

The `sentencepiece` library is not among this project's dependencies (nor in its venv), so the
references are (1) tests/support/reference_spm.py, llama.cpp's SentencePiece BPE algorithm written
out in Python from the file's tokens, scores and types, sharing no code with the tokenizer; and (2)
token ids the sentencepiece library itself gave for the same texts, computed once outside the venv
and stored with how (tests/support/gemma3_sentencepiece_ids.json)."""

import json
from pathlib import Path

import pytest

import reference_spm as ref
from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.tokenizer import SPACE, TextTokenizer, load_tokenizer, sentencepiece_bpe

SUPPORT = Path(__file__).parents[2] / "support"
STORED = json.loads((SUPPORT / "gemma3_sentencepiece_ids.json").read_text(encoding="utf-8"))
CORPUS = [
    *STORED["texts"],  # English, Chinese and other scripts, emoji, code, whitespace runs, HTML, JSON
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "a chat's <bos> and <eos> in the text",
    "\n" * 40 + " " * 70 + "\t" * 9 + "end",  # runs longer than the vocabulary's longest
]


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_model_path) -> TextTokenizer:
    return load_tokenizer(gemma_model_path)


@pytest.fixture(scope="module")
def reference_vocab(gemma_model_path) -> ref.SpmVocab:
    return ref.SpmVocab.from_gguf(gemma_model_path)


def test_gemma_encodes_as_the_sentencepiece_library_did(gemma_tokenizer):
    assert STORED["model_sha256"].startswith("a5fd3b62")
    for text, ids in zip(STORED["texts"], STORED["ids"], strict=True):
        assert gemma_tokenizer.encode(text, add_special_tokens=False) == ids, text


@pytest.mark.parametrize("text", CORPUS)
def test_gemma_encodes_and_decodes_as_the_reference(gemma_tokenizer, reference_vocab, text):
    """BOS first (add_bos_token), no prefix space (add_space_prefix false); decode gives the text."""
    ids = gemma_tokenizer.encode(text)
    assert ids == ref.encode(reference_vocab, text)
    assert ids[0] == 2 and gemma_tokenizer.decode(ids) == ref.decode(reference_vocab, ids)
    if "<" not in text:  # control tokens are skipped by decode
        assert gemma_tokenizer.decode(ids) == text


def test_gemma_special_tokens_and_known_ids(gemma_tokenizer):
    assert gemma_tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert gemma_tokenizer.eos_ids == (1, 106)  # <eos>, and <end_of_turn> ends a chat turn
    assert gemma_tokenizer.vocab_size == 262144 and gemma_tokenizer.byte_level
    assert gemma_tokenizer.encode("<start_of_turn>model\n", add_special_tokens=False) == [105, 4368, 107]
    assert gemma_tokenizer.token_piece(105) == ("<start_of_turn>", b"<start_of_turn>", True)
    assert gemma_tokenizer.token_bytes(238 + 0xF0) == b"\xf0"  # a byte-fallback token: its byte


@pytest.mark.parametrize("text", CORPUS)
def test_gemma_streaming_pieces_join_to_the_decode_without_broken_characters(gemma_tokenizer, text):
    ids = gemma_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(gemma_tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == gemma_tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_an_emoji_in_byte_tokens_is_held_back_until_whole(gemma_tokenizer):
    ids = gemma_tokenizer.encode("𓀀", add_special_tokens=False)  # outside the vocabulary: 4 bytes
    assert len(ids) == 4
    detok = IncrementalDetokenizer(gemma_tokenizer)
    assert [detok.add(t) for t in ids] == ["", "", "", "𓀀"]
    detok = IncrementalDetokenizer(gemma_tokenizer)
    assert [detok.add(t) for t in ids[:2]] + [detok.flush()] == ["", "", ""]  # cut: dropped


def test_gemma_chat_template_is_shipped_for_a_file_without_one(gemma_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": " And of Japan? "},
    ]
    assert gemma_tokenizer.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Japan?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = gemma_tokenizer.encode_chat(messages[1:2])
    assert ids[:3] == [2, 105, 2364] and ids[-3:] == [105, 4368, 107]  # one BOS, from the template


SMALL = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
PIECES = [SPACE + "t", "he", SPACE + "the", "ll", SPACE + "he", "llo", SPACE + "hello"]
PIECES += [SPACE, "t", "h", "e", "l", "o"]


def small_vocab(space_prefix: bool) -> tuple[list[str], list[float], list[int]]:
    """A Llama-2-style vocabulary: unknown, BOS, EOS, byte tokens, then pieces by falling score."""
    tokens = SMALL + PIECES
    scores = [0.0] * len(SMALL) + [-float(i) for i in range(len(PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
    return tokens, scores, types


@pytest.mark.parametrize("space_prefix", [True, False])
@pytest.mark.parametrize("text", ["hello the hell", "the  théo 😀", "", "  hello"])
def test_a_small_vocabulary_with_or_without_a_prefix_space_is_the_reference(space_prefix, text):
    """Llama 2 and Mistral add a prefix space (a U+2581 before the text), Gemma does not; characters
    outside the vocabulary fall back to their bytes."""
    tokens, scores, types = small_vocab(space_prefix)
    tokenizer = TextTokenizer(sentencepiece_bpe(tokens, scores, types, space_prefix, 0), None, None, None, ())
    vocab = ref.SpmVocab(tokens, scores, types, space_prefix)
    ids = tokenizer.encode(text)
    assert ids == ref.encode(vocab, text)
    assert tokenizer.decode(ids) == ref.decode(vocab, ids) == text
