"""The step plan and what it is made of: each group's capacity (from its `info` reply), the prompt
chunks, slot releases and decodes one plan runs. The BatchScheduler (scheduler/batch_scheduler.py)
makes plans; the engine (scheduler/step_executor.py) runs them on the groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from agent.contract.step import Proposal, StepLimits, proposal_size
from scheduler.sequence import Sequence


@dataclass
class GroupCapacity:
    """What the scheduler needs to know of one group (from its `info` reply)."""

    num_slots: int  # sequences placed at once
    max_seq_len: int  # positions of one sequence
    num_blocks: int  # the KV pool, in blocks of block_size positions
    block_size: int
    max_chunk: int  # the most prompt positions one prefill call computes
    role: str = "mixed"
    # whether a prefill may start past position 0 (chunks after the first, prefix-cache hits)
    chunked_prefill: bool = True
    mixed_rows: int = 0  # rows of one call that runs a decode and prompt chunks together (0: none)
    max_batch: int = 1  # the most sequences one decode (or mixed step) call takes
    # whether a prompt may reuse another's blocks (not with sliding-window layers' per-seat rings)
    prefix_caching: bool = True
    # the prefix cache's second tier (runtime.kv_tiers): None where the group keeps none, else the
    # digests its agent reported holding when connected (the block manager's tier index starts there)
    tier_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    # its tier outlives the agent (a disk tier): blocks are saved as they are computed (write-through)
    tier_write_through: bool = False
    tier_capacity: int | None = None  # the most blocks its tier holds (bounds the tier index)

    def mixes(self, decodes: int, chunks: list[Chunk], proposed: int = 0) -> bool:
        """Whether a step of `decodes` decode rows (with `proposed` tokens proposed after them)
        and these local chunks fits one mixed call: its rows, its sequences and its logit rows."""
        return bool(decodes and (chunks or proposed)) and self.limits.fits(
            decodes, proposed, [c.end - c.start for c in chunks], sum(c.sample for c in chunks)
        )

    @property
    def limits(self) -> StepLimits:
        """What one mixed step holds (the agent's runner checks the same rule)."""
        return StepLimits(self.mixed_rows, self.max_batch)

    def __post_init__(self) -> None:
        if self.max_seq_len > self.num_blocks * self.block_size:
            # one sequence alone must always fit, or preempting every other could not save it
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the KV pool "
                f"({self.num_blocks} blocks of {self.block_size} positions)"
            )

    @property
    def seats(self) -> int:
        """Slots the scheduler fills. A group that cannot recompute a preempted sequence in chunks
        (no chunked prefill; a decode group, which gets whole prompts from elsewhere) gets no more
        sequences than its pool holds at their longest, so it never needs to preempt."""
        if self.chunked_prefill and self.role != "decode":
            return self.num_slots
        return max(1, min(self.num_slots, self.num_blocks // -(-self.max_seq_len // self.block_size)))

    @property
    def max_prompt_len(self) -> int:
        """One position must stay free for an answer; without chunks, one call takes the prompt."""
        return self.max_seq_len - 1 if self.chunked_prefill else min(self.max_seq_len - 1, self.max_chunk)

    @property
    def prefills(self) -> bool:
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        return self.role != "prefill"


class Release(NamedTuple):
    group: int
    slot: int
    ticket: int | None = None  # a KV transfer into the slot that will never be used


class Chunk(NamedTuple):
    """Positions [start, end) of a sequence's tokens to compute; `sample`: the prompt's last chunk,
    whose logits give the first output token. With seq.prefill_group set, the whole prompt is
    computed on that group, which sends the KV to the sequence's decode group."""

    seq: Sequence
    start: int
    end: int
    sample: bool


@dataclass
class StepPlan:
    releases: list[Release] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    decodes: dict[int, list[Sequence]] = field(default_factory=dict)  # group -> its decoding seqs
    # request id -> the tokens proposed after its pending token (speculative decoding): verified
    # in its decode's step, and the blocks of their positions taken
    drafts: dict[str, Proposal] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.releases or self.prefills or self.decodes)

    def proposed(self, seqs: list[Sequence]) -> int:
        """Tokens proposed for these sequences."""
        return sum(proposal_size(self.drafts.get(s.request_id, [])) for s in seqs)

    def by_group(self) -> dict[int, StepPlan]:
        """The plan split into one plan per group it touches (a prefill belongs to the group that
        decodes it), in the same order within each group."""
        parts: dict[int, StepPlan] = {}
        for release in self.releases:
            parts.setdefault(release.group, StepPlan()).releases.append(release)
        for chunk in self.prefills:
            parts.setdefault(chunk.seq.placement[0], StepPlan()).prefills.append(chunk)
        for group, seqs in self.decodes.items():
            part = parts.setdefault(group, StepPlan())
            part.decodes[group] = seqs
            part.drafts = {
                s.request_id: self.drafts[s.request_id] for s in seqs if s.request_id in self.drafts
            }
        return parts


def attended(decodes: list[Sequence]) -> int:
    """Positions a decode step of these sequences attends to in all (each its own new one too)."""
    return sum(s.positions_used + 1 for s in decodes)
