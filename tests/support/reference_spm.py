"""An independent SentencePiece BPE tokenizer over a GGUF vocabulary (tokens, scores, token types), the
yardstick for agent/model/tokenizer.py's `tokenizers` build. It shares no tokenizer code with
agent/ (only the GGUF header reader, to read the vocabulary): it is llama.cpp's `llm_tokenizer_spm`
(itself SentencePiece's bpe_model.cc) written out in Python:

1. the text is cut at the vocabulary's special pieces, longest first: control tokens (<bos>,
   <start_of_turn>: the server's chat templates write them as text) and user-defined ones (Gemma's
   runs of newlines, spaces and tabs, HTML tags), each one token;
2. in each piece of text between them, spaces become U+2581 (a U+2581 first where the vocabulary
   adds a prefix space: llama.cpp's, at the start and after each special piece), the text is split
   into characters, and the adjacent pair whose concatenation is a piece of the highest score is
   merged, the leftmost of equal scores first, until no pair is a piece;
3. a symbol that is no piece (a character outside the vocabulary) becomes its UTF-8 bytes' <0xXX>
   tokens (byte fallback).

Decoding joins the pieces, U+2581 as a space and byte tokens as bytes (UTF-8, errors replaced).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


@dataclass
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool = False
    bos_id: int | None = None
    add_bos: bool = False

    def __post_init__(self) -> None:
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.mergeable = {
            t: i for i, t in enumerate(self.tokens) if self.types[i] in (NORMAL, USER_DEFINED, UNUSED)
        }
        self.specials = sorted(
            (t for i, t in enumerate(self.tokens) if self.types[i] in (CONTROL, USER_DEFINED) and t),
            key=len,
            reverse=True,
        )
        self.bytes = {int(t[3:5], 16): i for i, t in enumerate(self.tokens) if self.types[i] == BYTE}

    @classmethod
    def from_gguf(cls, path) -> SpmVocab:
        # The project's header reader (the gguf package's takes 50 s over Gemma's 262k pieces);
        # what it reads is checked apart, against ids the sentencepiece library gave.
        from agent.model.formats.gguf_header import GgufFile

        value = GgufFile(path).values.get
        return cls(
            value("tokenizer.ggml.tokens"),
            [float(s) for s in value("tokenizer.ggml.scores")],
            value("tokenizer.ggml.token_type"),
            bool(value("tokenizer.ggml.add_space_prefix", True)),
            value("tokenizer.ggml.bos_token_id"),
            bool(value("tokenizer.ggml.add_bos_token", False)),
        )


def partition(vocab: SpmVocab, text: str) -> list[str | int]:
    """The text cut at special pieces, longest first: a list of text fragments and token ids."""
    parts: list[str | int] = [text]
    for special in vocab.specials:
        out: list[str | int] = []
        for part in parts:
            if isinstance(part, int) or special not in part:
                out.append(part)
                continue
            pieces = part.split(special)
            for k, piece in enumerate(pieces):
                if piece:
                    out.append(piece)
                if k < len(pieces) - 1:
                    out.append(vocab.ids[special])
        parts = out
    return parts


def encode_fragment(vocab: SpmVocab, text: str) -> list[int]:
    symbols = list(text.replace(" ", SPACE))
    if not symbols:
        return []
    prev = list(range(-1, len(symbols) - 1))
    nxt = list(range(1, len(symbols) + 1))
    nxt[-1] = -1
    agenda: list[tuple[float, int, int, str]] = []

    def add_pair(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = symbols[left] + symbols[right]
        token = vocab.mergeable.get(merged)
        if token is not None:
            heapq.heappush(agenda, (-vocab.scores[token], left, right, merged))

    for i in range(len(symbols) - 1):
        add_pair(i, i + 1)
    while agenda:
        _, left, right, merged = heapq.heappop(agenda)
        # stale: either side changed since the pair was queued
        stale = not symbols[left] or not symbols[right] or nxt[left] != right
        if stale or symbols[left] + symbols[right] != merged:
            continue
        symbols[left], symbols[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add_pair(prev[left], left)
        add_pair(left, nxt[left])
    out: list[int] = []
    i = 0
    while i >= 0:
        piece = symbols[i]
        token = vocab.ids.get(piece)
        if token is not None and vocab.types[token] in (NORMAL, USER_DEFINED, UNUSED):
            out.append(token)
        else:
            out.extend(vocab.bytes[b] for b in piece.encode())
        i = nxt[i]
    return out


def encode(vocab: SpmVocab, text: str, add_bos: bool | None = None) -> list[int]:
    ids: list[int] = []
    if vocab.add_bos if add_bos is None else add_bos:
        assert vocab.bos_id is not None
        ids.append(vocab.bos_id)
    for part in partition(vocab, text):
        if isinstance(part, int):
            ids.append(part)
        elif part:  # llama.cpp prefixes the text at the start and after each special piece
            ids.extend(encode_fragment(vocab, " " + part if vocab.add_space_prefix else part))
    return ids


def decode(vocab: SpmVocab, ids: list[int], skip_control: bool = True) -> str:
    raw = bytearray()
    for token in ids:
        kind = vocab.types[token]
        if kind == CONTROL and skip_control:
            continue
        if kind == BYTE:
            raw.append(int(vocab.tokens[token][3:5], 16))
        else:
            raw += vocab.tokens[token].replace(SPACE, " ").encode()
    text = raw.decode("utf-8", "replace")
    return text[1:] if vocab.add_space_prefix and text.startswith(" ") else text
