"""GGUF vocabularies (`tokenizer.ggml.*`) as Hugging Face `tokenizers` Tokenizers, built as the
model's own tokenizer.json is, so that a text gives the ids the model was trained on (llama.cpp's
tokenizer suite is the check: its ids are the reference tokenizer's):

- `gpt2`: byte-level BPE from the tokens and merges, split first by the pre-tokenizer the file names
  (`tokenizer.ggml.pre`: PRE_TOKENIZERS, each the family's tokenizer.json pre_tokenizer and
  normalizer; llama.cpp's llama-vocab.cpp maps the same names to the same regexes);
- `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma 3, Phi-3) from the tokens, their scores and
  types: a BPE model whose merges are every split of a piece into two pieces, ranked by the merged
  piece's score (SentencePiece merges the adjacent pair whose piece scores highest, leftmost
  first), byte fallback (<0xXX> tokens) for characters outside the vocabulary, spaces as U+2581, a
  prefix space only where the file says (`add_space_prefix`);
- `gemma4`: BPE over raw UTF-8 with the file's merges, spaces as U+2581, byte fallback;
- `bert`: WordPiece (llama.cpp stores a word's first piece with a leading U+2581 and a
  continuation without tokenizer.json's `##`).

Control tokens are special (matched whole in the text, skipped by decode); user-defined tokens
(Qwen's <tool_call>, Gemma's runs of newlines and HTML tags ...) are matched whole and decoded as
text. Any other tokenizer model or pre-tokenizer is refused, naming it: never tokenized approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp's token types (tokenizer.ggml.token_type)
GGUF_NORMAL_TOKEN, GGUF_UNKNOWN_TOKEN, GGUF_CONTROL_TOKEN, GGUF_USER_DEFINED_TOKEN = 1, 2, 3, 4
GGUF_BYTE_TOKEN = 6
SPACE = "\u2581"  # SentencePiece's space

# The split regexes of the families' tokenizer.json files (Oniguruma syntax, as `tokenizers` runs them).
CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3 = (
    CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    rf"{CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM and Coder split by script before the byte-level step (their tokenizer.json Split list).
# Escaped: some of these characters have canonical equivalents that an editor may substitute.
DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated")


def _bytes(gpt2_regex: bool = False) -> pre_tokenizers.PreTokenizer:
    """The byte-level step: bytes as GPT-2's printable characters, split by GPT-2's own regex where
    the family has no split of its own."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex)


@dataclass(frozen=True)
class PreTokenizer:
    """A family's pre-tokenization: its steps, NFC normalization first (Qwen, GPT-NeoX, Cohere),
    and ignore_merges (a split that is a token is that token, Llama 3's and Tekken's BPE)."""

    steps: Callable[[], list[pre_tokenizers.PreTokenizer]]
    nfc: bool = False
    ignore_merges: bool = False


_GPT2 = PreTokenizer(lambda: [_bytes(gpt2_regex=True)])
_DIGITS_GPT2 = PreTokenizer(lambda: [pre_tokenizers.Digits(individual_digits=True), _bytes(gpt2_regex=True)])
_LLAMA3 = PreTokenizer(lambda: [_split(LLAMA3), _bytes()], ignore_merges=True)
_QWEN2 = PreTokenizer(lambda: [_split(QWEN2), _bytes()], nfc=True)

# GGUF pre-tokenizer names (tokenizer.ggml.pre) -> the family's pre-tokenization; aliases as llama.cpp
# maps them. Each passes llama.cpp's tokenizer suite token for token
# (tests/unit/agent/test_tokenizer_suite.py; smollm: tests/unit/agent/test_tokenizer.py) except those
# marked "no suite": built from the family's tokenizer.json split, checked against no reference ids.
# NFC for mpt and command-r follows their tokenizer.json; no suite text tells it apart.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "mpt": PreTokenizer(_GPT2.steps, nfc=True),
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "command-r": PreTokenizer(_DIGITS_GPT2.steps, nfc=True),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": PreTokenizer(_LLAMA3.steps),  # no suite: Llama 3's split without ignore_merges
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": PreTokenizer(lambda: [_split(QWEN35), _bytes()]),
    "gpt-4o": PreTokenizer(lambda: [_split(GPT4O), _bytes()]),  # no suite
    "tekken": PreTokenizer(lambda: [_split(TEKKEN), _bytes()], ignore_merges=True),  # no suite
    "deepseek-llm": PreTokenizer(
        lambda: [
            *map(_split, ["[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCTUATION, r"\s+$", CJK]),
            pre_tokenizers.Digits(individual_digits=False),
            _bytes(),
        ]
    ),
    "deepseek-coder": PreTokenizer(
        lambda: [
            *map(_split, ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK]),
            pre_tokenizers.Digits(individual_digits=True),
            _bytes(),
        ]
    ),
    "falcon": PreTokenizer(
        lambda: [
            pre_tokenizers.Punctuation(behavior="contiguous"),
            _bytes(gpt2_regex=True),
            pre_tokenizers.Digits(individual_digits=False),
            _split("[0-9][0-9][0-9]"),
        ]
    ),
}


class VocabularyError(Exception):
    """The file's vocabulary is one this module cannot reproduce exactly."""


def byte_level_bpe(pre: str, tokens: list[str], types: list[int], merges: list[str]) -> Tokenizer:
    recipe = PRE_TOKENIZERS.get(pre)
    if recipe is None:
        raise VocabularyError(
            f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=recipe.ignore_merges))
    if recipe.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(recipe.steps())
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, tokens, types)
    return tokenizer


def gemma4_bpe(tokens: list[str], types: list[int], merges: list[str]) -> Tokenizer:
    """Gemma 4: BPE with merges over raw UTF-8 (not byte-level), spaces as U+2581, byte fallback;
    each run of newlines apart (llama.cpp splits the same)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = _split("\n+")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    _add_tokens(tokenizer, tokens, types)
    return tokenizer


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    space_prefix: bool,
    unknown: int | None = None,
) -> Tokenizer:
    """A SentencePiece BPE vocabulary (module docstring) as a `tokenizers` BPE model."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, scores, types)
    unk = tokens[unknown] if unknown is not None and 0 <= unknown < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if space_prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    _add_tokens(tokenizer, tokens, types)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every pair of pieces whose concatenation is a piece, the pairs of higher-scoring pieces first
    (ties: by the pieces' ids): SentencePiece's merge order as BPE merge ranks. Pieces that merges
    may form are the normal and user-defined ones (SentencePiece's own; control and byte tokens
    are never formed)."""
    pieces = {
        token: i for i, token in enumerate(tokens) if types[i] in (GGUF_NORMAL_TOKEN, GGUF_USER_DEFINED_TOKEN)
    }
    ranked = []
    for piece, i in pieces.items():
        for cut in range(1, len(piece)):
            left, right = pieces.get(piece[:cut]), pieces.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in ranked]


def wordpiece(tokens: list[str], types: list[int], unknown: int | None) -> Tokenizer:
    """BERT's WordPiece (BGE): lowercased, accents stripped, CJK characters apart, split on spaces
    and punctuation, then the longest piece first."""
    vocab = {
        _wordpiece_token(token, kind): i for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
    }
    unk = tokens[unknown] if unknown is not None and 0 <= unknown < len(tokens) else "[UNK]"
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    _add_tokens(tokenizer, tokens, types)
    return tokenizer


def _wordpiece_token(token: str, kind: int) -> str:
    """tokenizer.json's form of a GGUF WordPiece token: a word's first piece loses its U+2581, a
    continuation gets `##` back; control tokens ([CLS] ...) stay as they are."""
    if kind == GGUF_CONTROL_TOKEN:
        return token
    return token[1:] if token.startswith(SPACE) else "##" + token


def _add_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == GGUF_USER_DEFINED_TOKEN
        ]
    )
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (GGUF_CONTROL_TOKEN, GGUF_UNKNOWN_TOKEN)
        ]
    )
