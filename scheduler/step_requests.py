"""A plan's agent calls as the agents take them (StepRequest, agent/contract/step.py): the slots,
block tables, tokens, sampling and token masks of the sequences one call decodes and of the prompt
chunks it computes. The BatchScheduler (scheduler/batch_scheduler.py) decides which calls a plan
makes; these functions only write them down, from the state the plan left."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from agent.contract.step import Proposal, StepChunk, StepRequest
from scheduler.block_manager import BlockManager
from scheduler.plan import Chunk
from scheduler.sequence import Sequence


def step_request(
    blocks: BlockManager,
    decodes: list[Sequence],
    chunks: list[Chunk],
    drafts: Mapping[str, Proposal],
    tier_moves: bool,
) -> StepRequest:
    """One call of a group: its decode rows (with the tokens proposed after them) and its prompt
    chunks; with `tier_moves` (the group's first call of the plan) the KV tier's moves queued since
    its last step, which run before the call writes or reads a block."""
    return StepRequest(
        [s.placement[1] for s in decodes],
        [blocks.table(s.request_id) for s in decodes],
        [_step_chunk(blocks, c) for c in chunks],
        _masks([*decodes, *(c.seq for c in chunks if c.sample)]),
        {s.placement[1]: drafts[s.request_id] for s in decodes if s.request_id in drafts},
        spill=blocks.take_spills() if tier_moves else [],
        restore=blocks.take_restores() if tier_moves else [],
    )


def transfer_request(prefill_blocks: BlockManager, chunk: Chunk) -> StepRequest:
    """PD disaggregation: the whole prompt computed on its prefill group's slot, from its
    prefix-cache hit (chunk.start); where its KV goes is the step's KVDestination."""
    seq = chunk.seq
    prefill_slot = seq.prefill_placement[1]
    whole = StepChunk(
        prefill_slot,
        seq.prompt,
        prefill_blocks.table(seq.request_id),
        chunk.start,
        seq.sampling,
        prompt_logprobs=seq.sampling.prompt_logprobs if scores(chunk) else None,
    )
    return StepRequest(chunks=[whole], masks=_masks([seq], prefill_slot))


def scores(chunk: Chunk) -> bool:
    """Whether the chunk scores its prompt positions: its sequence asked for prompt logprobs and
    has them up to the chunk's start (a recompute from position 0 scores them again)."""
    seq = chunk.seq
    return seq.scoring_prompt and chunk.start <= len(seq.prompt_logprobs) and chunk.end <= len(seq.prompt)


def _step_chunk(blocks: BlockManager, chunk: Chunk) -> StepChunk:
    """The planned chunk as the agents take it: the slot's tokens up to its end, its blocks, and its
    sequence's sampling where it samples."""
    seq = chunk.seq
    scored = scores(chunk)
    return StepChunk(
        seq.placement[1],
        seq.tokens(chunk.end),
        blocks.table(seq.request_id),
        chunk.start,
        seq.sampling if chunk.sample else None,
        prompt_logprobs=seq.sampling.prompt_logprobs if scored else None,
        lookahead=seq.prompt[chunk.end] if scored and chunk.end < len(seq.prompt) else None,
        restore=chunk.restore,
        save=chunk.save,
    )


def _masks(seqs: Iterable[Sequence], slot: int | None = None) -> dict[int, np.ndarray]:
    """The token masks of the sequences whose next token is constrained, by slot (structured
    output, a spent thinking budget); `slot`: the one sequence's slot on a prefill group."""
    masks = {
        s.placement[1] if slot is None else slot: s.constraint.mask()
        for s in seqs
        if s.constraint is not None
    }
    return {at: mask for at, mask in masks.items() if mask is not None}
