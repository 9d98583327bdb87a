"""Incremental, UTF-8-safe detokenization: text pieces that join to exactly the full decode.

A byte-level BPE token may end in the middle of a multi-byte character. For byte-level tokenizers
(TextTokenizer.byte_level: GPT-2 style byte-level BPE, as Llama 3, Qwen and DeepSeek have, and
Gemma's pieces) each token's bytes go through an incremental UTF-8 decoder, which holds back
exactly the bytes of an unfinished character; a U+FFFD the model generates as a character (its
bytes EF BF BD) is text like any other and is emitted.

Other tokenizers decode a window of recent ids each step (the vLLM prefix/read offsets), so a long
answer costs O(length), not O(length^2); there a piece whose decode ends in U+FFFD is held back, as
the text cannot tell a real U+FFFD from an unfinished character.

Special tokens are no text (a decode skips them), except the `shown` ones: a format's markers that
an answer is read by (Mistral's [TOOL_CALLS], a control token), written as their names.
"""

from __future__ import annotations

import codecs

from agent.model.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, shown: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.shown = shown
        # errors="replace": invalid bytes become U+FFFD, as in the full decode
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if tokenizer.byte_level else None
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window (other tokenizers)
        self.read_offset = 0  # ids up to here have been emitted as text (other tokenizers)
        self.text = ""  # everything emitted so far

    def add(self, token: int) -> str:
        """Append one token id; returns the new text that is safe to emit (may be empty)."""
        self.ids.append(token)
        if token in self.shown:  # what came before it is whole: a character it cut stays cut
            piece = self._cut() + self.tokenizer.token_piece(token)[0]
        elif self.utf8 is not None:
            piece = self.utf8.decode(self.tokenizer.token_bytes(token))
        else:
            piece = self._window_piece()
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of a sequence: what is still held back, less a character the end cut in half
        (max_new_tokens reached mid-emoji); its bytes would only decode to U+FFFD."""
        if self.utf8 is not None:
            self.utf8.reset()  # drops the bytes of the cut character, nothing else is held
            return ""
        tail = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        piece = tail[len(prefix_text) :].rstrip(REPLACEMENT)
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece

    def _cut(self) -> str:
        """The text held back before a shown token (its ids are the last but one); the window
        starts after it."""
        if self.utf8 is not None:
            return self.utf8.decode(b"", final=True)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        piece = decode(self.ids[self.prefix_offset : -1])[len(prefix_text) :]
        self.read_offset = len(self.ids)  # the window goes on over it (a decode skips it)
        return piece

    def _window_piece(self) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = decode(self.ids[self.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window_text[len(prefix_text) :]
