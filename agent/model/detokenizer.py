"""Incremental, UTF-8-safe detokenization: text pieces that join to exactly the full decode.

A byte-level BPE token may end in the middle of a multi-byte character; its decode then ends in U+FFFD.
Such a piece is held back until the character completes. Only a window of recent ids is decoded each
step (the vLLM prefix/read offsets), so a long answer costs O(length), not O(length^2).
"""

from __future__ import annotations

from agent.model.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids up to here have been emitted as text
        self.text = ""  # everything emitted so far

    def add(self, token: int) -> str:
        """Append one token id; returns the new text that is safe to emit (may be empty)."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = decode(self.ids[self.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT):
            return ""
        piece = window_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of a sequence: what is still held back, less a character the end cut in half
        (max_new_tokens reached mid-emoji); its bytes would only decode to U+FFFD."""
        tail = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        piece = tail[len(prefix_text) :].rstrip(REPLACEMENT)
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece
