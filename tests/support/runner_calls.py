"""A runner's steps in the shapes tests assert on, each one StepRequest through ModelRunner.execute
(its one entry point), returning token ids where a test compares token ids:

    first = prefill(runner, slot, ids, params, table)    # a prompt's last (or only) chunk: its first token
    prefill_chunk(runner, slot, ids[:end], table, start)  # a chunk before the prompt's last
    nexts = decode(runner, [slot, ...], [table, ...])     # one token for each slot, in order
    decoded, firsts = step(runner, slots, tables, chunks, masks, drafts)  # any step: token ids

A test that asserts on logprobs, prompt logprobs or faults reads them from the StepReply of
runner.execute itself. Without a table a chunk is computed in the slot's fixed one, and a decode
without tables uses each slot's table of its last call (ModelRunner.execute)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from agent.contract.sampling import SamplingParams
from agent.contract.step import BlockTable, StepChunk, StepRequest

Score = tuple[int, int | None]  # prompt logprobs asked of a chunk: (k, lookahead token id or None)


def chunk(
    slot: int,
    tokens: Sequence[int],
    params: SamplingParams | None,
    table: BlockTable | None = None,
    start: int = 0,
    score: Score | None = None,
    restore: int | None = None,
    save: int | None = None,
) -> StepChunk:
    """Positions start..len(tokens)-1 of the slot's sequence; `params`: the prompt's last chunk
    samples its first token with them (None: it samples nothing); `score`: its prompt logprobs;
    `restore`, `save`: the state snapshots it starts from and saves into (Gated DeltaNet layers)."""
    k, lookahead = score if score is not None else (None, None)
    return StepChunk(
        slot, tokens, table, start, params, prompt_logprobs=k, lookahead=lookahead, restore=restore, save=save
    )


def prefill(
    runner,
    slot: int,
    tokens: Sequence[int],
    params: SamplingParams,
    table: BlockTable | None = None,
    start: int = 0,
    mask: np.ndarray | None = None,
    score: Score | None = None,
    restore: int | None = None,
) -> int:
    """A prompt's last (or only) chunk alone: its first token (`mask`: the tokens it may be)."""
    masks = {} if mask is None else {slot: mask}
    reply = runner.execute(
        StepRequest(chunks=[chunk(slot, tokens, params, table, start, score, restore)], masks=masks)
    )
    return reply.firsts[0].token


def prefill_chunk(
    runner,
    slot: int,
    tokens: Sequence[int],
    table: BlockTable | None,
    start: int = 0,
    score: Score | None = None,
    restore: int | None = None,
    save: int | None = None,
) -> None:
    """A chunk before the prompt's last (or a preempted sequence's recompute) alone: samples nothing."""
    runner.execute(StepRequest(chunks=[chunk(slot, tokens, None, table, start, score, restore, save)]))


def decode(
    runner,
    slots: Sequence[int],
    tables: Sequence[BlockTable] | None = None,
    masks: Mapping[int, np.ndarray] | None = None,
) -> list[int]:
    """One decode step of `slots`: each slot's next token, in order."""
    reply = runner.execute(StepRequest(slots=list(slots), tables=list(tables or ()), masks=dict(masks or {})))
    return [tokens[0].token for tokens in reply.decoded]


def step(
    runner,
    slots: Sequence[int],
    tables: Sequence[BlockTable],
    chunks: Sequence[StepChunk],
    masks: Mapping[int, np.ndarray] | None = None,
    drafts: Mapping[int, Sequence[int]] | None = None,
) -> tuple[list[list[int]], list[int | None]]:
    """Any step: each decode slot's token ids (with proposals: the ones kept and one more) and each
    chunk's first token id (None unless it samples)."""
    request = StepRequest(
        slots=list(slots),
        tables=list(tables),
        chunks=list(chunks),
        masks=dict(masks or {}),
        drafts={slot: list(tokens) for slot, tokens in (drafts or {}).items()},
    )
    reply = runner.execute(request)
    return (
        [[s.token for s in tokens] for tokens in reply.decoded],
        [None if first is None else first.token for first in reply.firsts],
    )
