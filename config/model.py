"""The served model: its name, aliases and file (or the MindIR graphs exported from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Section, resolve_path


class ModelSection(Section):
    name: str = Field("smollm2-135m-instruct", description="served model name (upstream ModelName)")
    aliases: list[str] = Field(default_factory=list)
    path: Path = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    # Graphs exported by `python -m tools.export` (upstream's names). When set, the agents run these
    # MindIR files instead of building the graphs from `path`, which then only gives the tokenizer.
    prefill_model: list[Path] = Field(default_factory=list, description="one MindIR file per prefill bucket")
    decode_model: list[Path] = Field(default_factory=list, description="one MindIR file per decode bucket")
    argmax_model: Path | None = None
    topk_model: list[Path] = Field(default_factory=list, description="one MindIR file per top-k bucket")
    # How answers are read (server/tool_calls.py, server/reasoning.py); auto: from the chat template.
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_xml"] = Field(
        "auto",
        description="tool calls as `<tool_call>` JSON (hermes), a whole-answer JSON call (llama3_json), "
        "or after `[TOOL_CALLS]` (mistral), or `<tool_call>` around `<function=NAME>` and "
        "`<parameter=P>` blocks (qwen3_xml: Qwen3.5, Qwen3-Coder)",
    )
    reasoning_parser: Literal["auto", "think", "mistral", "none"] = Field(
        "auto",
        description="the answer's reasoning, apart from its content: `<think>...</think>` (think) "
        "or `[THINK]...[/THINK]` (mistral: Magistral)",
    )

    # Pooling (server/pooling.py): what /v1/embeddings, /score and /rerank return for this model.
    pooling: Literal["auto", "none", "last", "mean", "cls", "rank"] = Field(
        "auto",
        description="embeddings from the last token's final hidden state (last: Qwen3-Embedding), "
        "from the mean of every token's or the first token's (mean, cls: an encoder's, "
        "EmbeddingGemma's), relevance from the last token's label logits (rank: Qwen3-Reranker), or "
        "none; auto: the file's (a GGUF's pooling_type, sentence-transformers' modules.json), else none",
    )
    pooling_normalize: bool = Field(True, description="embeddings scaled to length 1")
    matryoshka_dimensions: list[int] | None = Field(
        None,
        description="the `dimensions` an embedding may be truncated to (Matryoshka); None: the "
        "file's (Hugging Face config matryoshka_dimensions), else none",
    )

    @field_validator("path", "argmax_model")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        return None if path is None else resolve_path(path)

    @field_validator("prefill_model", "decode_model", "topk_model")
    @classmethod
    def _all_absolute(cls, paths: list[Path]) -> list[Path]:
        return [resolve_path(p) for p in paths]

    @property
    def uses_mindir(self) -> bool:
        return self.argmax_model is not None

    @model_validator(mode="after")
    def _mindir_all_or_none(self) -> ModelSection:
        given = [
            bool(self.prefill_model),
            bool(self.decode_model),
            self.argmax_model is not None,
            bool(self.topk_model),
        ]
        if any(given) and not all(given):
            raise ValueError(
                "prefill_model, decode_model, argmax_model and topk_model come together "
                "(python -m tools.export prints all four)"
            )
        return self
