"""Tokenizer and chat template from the model's own files (GGUF vocabulary or tokenizer.json).

GGUF vocabularies are built into a HuggingFace `tokenizers` Tokenizer by agent/model/gguf_vocab.py
(byte-level BPE with each family's pre-tokenizer, SentencePiece BPE, Gemma 4's BPE, WordPiece).

A file without a chat template gets the one its family ships with (agent/model/templates/, named by
the family's module in agent/model/families/).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, processors

from agent.model.chat_template import ChatTemplate, ChatTemplateError, RenderBudgetError
from agent.model.families import GGUF
from agent.model.formats.gguf_file import gguf_eos_ids, gguf_field, read_gguf
from agent.model.gguf_vocab import (
    GGUF_NORMAL_TOKEN,
    SPACE,
    VocabularyError,
    byte_level_bpe,
    gemma4_bpe,
    sentencepiece_bpe,
    wordpiece,
)

TEMPLATES = Path(__file__).parent / "templates"
# GGUF pre-tokenizers whose vocabularies add BOS where the file does not say (llama.cpp's default)
BOS_PRE_TOKENIZERS = ("llama-bpe", "llama3", "llama-v3", "tekken")


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return {char: byte for byte, char in chars.items()}


BYTE_OF_CHAR = _byte_of_char()


class TokenizerError(Exception):
    """The model files carry no usable tokenizer or chat template."""


class TextTokenizer:
    """Text <-> token ids, and messages -> prompt text through the model's chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_ids: tuple[int, ...],
        pieces: bool = False,
    ):
        """pieces: the tokens are SentencePiece pieces that concatenate to the decode (no prefix
        space to strip): a piece's bytes are its text with U+2581 as a space, a <0xXX> token's its
        byte (token_bytes)."""
        self.tokenizer = tokenizer
        self.pieces = pieces
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_ids = eos_ids
        self._template = ChatTemplate(chat_template) if chat_template else None
        self._added = tokenizer.get_added_tokens_decoder()
        self._bytes: dict[int, bytes] = {}
        self._special_ids: dict[tuple[str, ...], frozenset[int]] = {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: what the model's tokenizer adds around plain text (BOS, if any)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        # The byte-level decoder would read an added token's text as bytes (DeepSeek's "ø" as the
        # byte F8): join the tokens' bytes as streaming does (token_bytes), specials named if kept.
        parts = []
        for token in ids:
            added = self._added.get(token)
            if added is not None and added.special:
                parts.append(b"" if skip_special_tokens else added.content.encode())
            else:
                parts.append(self.token_bytes(token))
        return b"".join(parts).decode("utf-8", "replace")

    @property
    def byte_level(self) -> bool:
        """Whether every token stands for bytes (token_bytes) that join to the decode: GPT-2 style
        byte-level BPE, and SentencePiece pieces without a prefix space (`pieces`)."""
        return self.pieces or isinstance(self.tokenizer.decoder, decoders.ByteLevel)

    def token_bytes(self, token: int) -> bytes:
        """A byte-level token's bytes (b"" for a special token, which decode skips); unlike decode,
        a token that holds part of a character keeps its bytes. Cached: the vocabulary is fixed."""
        cached = self._bytes.get(token)
        if cached is None:
            cached = self._bytes[token] = self._uncached_token_bytes(token)
        return cached

    def _uncached_token_bytes(self, token: int) -> bytes:
        added = self._added.get(token)
        if added is not None:  # added tokens are their text, not byte-level characters
            return b"" if added.special else added.content.encode()
        text = self.tokenizer.id_to_token(token)
        if text is None:
            return b""  # decode skips an unknown id too
        if self.pieces:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])  # a byte-fallback token
            return text.replace(SPACE, " ").encode()
        return bytes(BYTE_OF_CHAR[char] for char in text if char in BYTE_OF_CHAR)

    def special_ids(self, texts: tuple[str, ...]) -> frozenset[int]:
        """The ids of those texts that the vocabulary holds as one special token (a format's
        markers: Mistral's [TOOL_CALLS], Magistral's [THINK]), which a decode drops. Cached: asked
        for the same markers at every chat request's admission."""
        cached = self._special_ids.get(texts)
        if cached is None:
            ids = [self.encode(text, add_special_tokens=False) for text in texts]
            cached = frozenset(i[0] for i in ids if len(i) == 1 and self.token_piece(i[0])[2])
            self._special_ids[texts] = cached
        return cached

    def token_piece(self, token: int) -> tuple[str, bytes, bool]:
        """One token alone, as logprobs show it: its text (a special token's is its name; a token
        holding part of a character shows U+FFFD), its bytes, and whether it is special."""
        added = self._added.get(token)
        if added is not None:
            return added.content, added.content.encode(), added.special
        if self.byte_level:
            raw = self.token_bytes(token)
            return raw.decode("utf-8", "replace"), raw, False
        text = self.decode([token], skip_special_tokens=False)
        return text, text.encode(), False

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (Qwen, Hermes, Llama 3.1 ...)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        kwargs: dict | None = None,
        max_chars: int | None = None,
    ) -> str:
        """`kwargs`: more template variables (a request's chat_template_kwargs); `max_chars`: the
        longest prompt wanted (chat_template.RenderBudgetError past it, or past the render budget)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template")
        try:
            return self._template.render(
                messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
                tools=tools or None,
                kwargs=kwargs,
                max_chars=max_chars,
            )
        except RenderBudgetError:
            raise
        except ChatTemplateError as exc:
            raise TokenizerError(f"the chat template refused these messages: {exc}") from exc

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes BOS itself where the model wants one.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def save(self, directory: Path) -> None:
        """tokenizer.json + tokenizer_config.json, which `load_tokenizer(directory)` reads back."""
        self.tokenizer.save(str(directory / "tokenizer.json"))
        config = {
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        (directory / "tokenizer_config.json").write_text(
            json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8"
        )

    def check_fits(self, vocab_size: int) -> None:
        """The tokenizer may not produce ids the model has no embedding for."""
        if self.vocab_size > vocab_size:
            raise TokenizerError(
                f"vocab/weight mismatch: the tokenizer has {self.vocab_size} "
                f"tokens but the model's embedding has {vocab_size} rows"
            )


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """From a .gguf file (its vocabulary and merges) or a directory with tokenizer.json (for a
    .ckpt file: its directory)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_file() and path.suffix == ".ckpt":
        path = path.parent
    if path.is_dir():
        return _from_hf_dir(path)
    raise TokenizerError(f"no tokenizer at {path}: expected a .gguf file or a model directory")


def _from_gguf(path: Path) -> TextTokenizer:
    reader = read_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [GGUF_NORMAL_TOKEN] * len(tokens)
    try:
        tokenizer, pieces, add_bos = _gguf_vocabulary(reader, kind, tokens, types)
    except VocabularyError as exc:
        raise TokenizerError(f"{path}: {exc}") from exc

    def token_at(key: str) -> str | None:
        index = gguf_field(reader, key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    if gguf_field(reader, "tokenizer.ggml.add_bos_token", add_bos) and bos is not None:
        bos_id = int(gguf_field(reader, "tokenizer.ggml.bos_token_id"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    architecture = gguf_field(reader, "general.architecture")
    template = gguf_field(reader, "tokenizer.chat_template") or shipped_template(architecture)
    return TextTokenizer(
        tokenizer,
        template,
        bos_token=bos,
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        eos_ids=gguf_eos_ids(reader),
        pieces=pieces,
    )


def _gguf_vocabulary(reader, kind: str, tokens: list[str], types: list[int]) -> tuple[Tokenizer, bool, bool]:
    """The file's vocabulary as a Tokenizer; whether its tokens are SentencePiece pieces
    (TextTokenizer's `pieces`); whether it adds BOS where the file does not say (llama.cpp's
    defaults: SentencePiece and Llama 3's and Tekken's BPE do)."""
    merges = gguf_field(reader, "tokenizer.ggml.merges") or []
    unknown = gguf_field(reader, "tokenizer.ggml.unknown_token_id")
    if kind == "gpt2":
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
        return byte_level_bpe(pre, tokens, types, merges), False, pre in BOS_PRE_TOKENIZERS
    if kind == "llama":
        scores = gguf_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        space_prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
        return sentencepiece_bpe(tokens, scores, types, space_prefix, unknown), not space_prefix, True
    if kind == "gemma4":
        return gemma4_bpe(tokens, types, merges), True, True
    if kind == "bert":
        return wordpiece(tokens, types, unknown), False, False
    raise VocabularyError(
        f"tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE, llama "
        "SentencePiece BPE, gemma4 BPE, bert WordPiece)"
    )


def shipped_template(architecture: str | None) -> str | None:
    """The chat template this project ships for a GGUF architecture (agent/model/templates/), if any."""
    layout = GGUF.get(architecture or "")
    name = None if layout is None else layout.chat_template
    return None if name is None else (TEMPLATES / name).read_text(encoding="utf-8")


def _special_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _from_hf_dir(directory: Path) -> TextTokenizer:
    from agent.model.formats.hf_dir import hf_eos_ids, read_json

    file = directory / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(f"{directory}: no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise TokenizerError(f"{file}: cannot load tokenizer ({exc})") from exc
    config_file = directory / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates; "default" is what generation uses
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    model_config = read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
    return TextTokenizer(
        tokenizer,
        template,
        bos_token=_special_text(config.get("bos_token")),
        eos_token=_special_text(config.get("eos_token")),
        eos_ids=hf_eos_ids(directory, model_config),
    )
