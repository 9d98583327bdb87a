"""The step plan, what it is made of and what running it came to: each group's capacity (from its
`info` reply); the slot releases, decodes and prompt chunks one plan runs; the agent steps they
become (PlannedStep, one agent call each); and each call's outcome (StepOutcome). The
BatchScheduler (scheduler/batch_scheduler.py) makes plans, final to the last call, and takes the
outcomes back (update); the StepExecutor (scheduler/step_executor.py) runs them and decides
nothing."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from agent.contract.step import Proposal, StepLimits, StepRequest, proposal_size
from agent.contract.step_reply import StepReply
from scheduler.sequence import Sequence
from scheduler.timeline import AgentCall


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
    # whether a prompt may reuse another's blocks (not with sliding-window layers' per-slot rings)
    prefix_caching: bool = True
    # the prefix cache's second tier (runtime.kv_tiers): None where the group keeps none, else the
    # digests its agent reported holding when connected (the block manager's tier index starts there)
    tier_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    # its tier outlives the agent (a disk tier): blocks are saved as they are computed (write-through)
    tier_write_through: bool = False
    tier_capacity: int | None = None  # the most blocks its tier holds (bounds the tier index)
    # Gated DeltaNet layers (Qwen3.5's): the snapshot slots of their states a prefix-cache hit needs
    # (scheduler/state_snapshots.py); 0: the model has none, or keeps no snapshots
    state_snapshots: int = 0
    # the most tokens proposed for one sequence a step of the agent verifies (0: none; a hybrid
    # model's states hold rows for as many as its runtime.speculation num_tokens)
    max_proposals: int = 0

    def mixes(self, decodes: int, chunks: list[Chunk], proposed: int = 0) -> bool:
        """Whether a step of `decodes` decode rows (with `proposed` tokens proposed after them)
        and these local chunks fits one mixed call: its rows, its sequences and its logit rows.
        Prompt chunks alone mix too where there are several (an embedding job's inputs: one call
        reads the weights once for all of them, and their first tokens come out together)."""
        return bool((decodes and (chunks or proposed)) or len(chunks) > 1) and self.limits.fits(
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
    def usable_slots(self) -> int:
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
    # the slot's sequence keeps it: only the agent's state of it goes (a failed tier restore left
    # it computed from garbage; the sequence is recomputed into it)
    keep: bool = False


class Chunk(NamedTuple):
    """Positions [start, end) of a sequence's tokens to compute; `sample`: the prompt's last chunk,
    whose logits give the first output token. With seq.prefill_group set, the whole prompt is
    computed on that group, which sends the KV to the sequence's decode group."""

    seq: Sequence
    start: int
    end: int
    sample: bool
    restore: int | None = None  # the state snapshot it starts from (scheduler/state_snapshots.py)
    save: int | None = None  # the state snapshot it saves at its end


class PromptBudget(NamedTuple):
    """Prompt positions one group's step may compute: all prompts together, and of those the
    pooling requests' (batch work, bounded on its own beside decode rows)."""

    positions: int
    pooling: int


class KVDestination(NamedTuple):
    """Where a transfer's KV goes: the decode group's slot and blocks, under the transfer's ticket
    (the executor adds the agent's address and this server's session there: agent/contract/step.py
    KVTransfer)."""

    group: int
    slot: int
    ticket: int
    table: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class PlannedStep:
    """One agent call of a plan: the request its group's agent takes, and the part of the plan it
    carries (the sequences it decodes, with the tokens proposed after them, and the prompt chunks it
    computes). A transfer (`send_to` set) is a whole prompt computed on its prefill group (`group`),
    its KV sent to its decode group."""

    group: int
    request: StepRequest
    send_to: KVDestination | None = None
    decodes: tuple[Sequence, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    drafts: Mapping[str, Proposal] = field(default_factory=dict)  # by request id
    attending: int = 0  # positions the decode rows attend to in all (the step costs' measure)

    @property
    def plain_decode(self) -> bool:
        """A decode of its rows and nothing else: refused, its group cannot decode at all."""
        return bool(self.decodes) and not (self.chunks or self.drafts)

    @property
    def mixed(self) -> bool:
        """Decode rows with prompt chunks or proposals, or several chunks, in one call: refused, its
        parts run alone."""
        return (bool(self.decodes) and not self.plain_decode) or len(self.chunks) > 1


@dataclass
class PlanPart:
    """What one group runs of a plan, in this order: its slot releases, then its agent steps."""

    group: int
    releases: list[Release] = field(default_factory=list)
    steps: list[PlannedStep] = field(default_factory=list)


@dataclass
class StepPlan:
    releases: list[Release] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    decodes: dict[int, list[Sequence]] = field(default_factory=dict)  # group -> its decoding seqs
    # request id -> the tokens proposed after its pending token (speculative decoding): verified
    # in its decode's step, and the blocks of their positions taken
    drafts: dict[str, Proposal] = field(default_factory=dict)
    # the agent calls the plan is made of (the scheduler's last word on it): each group's part,
    # and the transfers (PD disaggregation), each a task of its own (decode steps never wait for it)
    parts: dict[int, PlanPart] = field(default_factory=dict)
    transfers: list[PlannedStep] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.releases or self.prefills or self.decodes)

    def proposed(self, seqs: list[Sequence]) -> int:
        """Tokens proposed for these sequences."""
        return sum(proposal_size(self.drafts.get(s.request_id, [])) for s in seqs)

    def part(self, group: int) -> PlanPart:
        return self.parts.setdefault(group, PlanPart(group))


class Failure(enum.Enum):
    """Why an agent call gave no reply."""

    REFUSED = "refused"  # the agent refused it as a bad request: nothing of it ran
    AGENT = "agent"  # the agent failed, or is unreachable: its group is lost
    INTERNAL = "internal"  # running it failed here (a bug): its sequences end, the group is fine


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What one call of a plan came to: the agent's reply, or why there is none (the exception, and
    its kind); the call as timed (its round trip: call.end - call.start) and the agent's own compute
    time for it."""

    group: int
    agent: str  # the group's address
    part: PlannedStep | Release
    reply: StepReply | None = None
    error: BaseException | None = None
    failure: Failure | None = None
    call: AgentCall | None = None
    compute_s: float = 0.0

    @property
    def group_failure(self) -> BaseException | None:
        """The error that loses the group: its agent failed, or refused what every step needs (a
        slot release, a decode alone)."""
        if self.failure is Failure.AGENT:
            return self.error
        part = self.part
        lost = isinstance(part, Release) or part.plain_decode
        return self.error if self.failure is Failure.REFUSED and lost else None


def attended(decodes: list[Sequence]) -> int:
    """Positions a decode step of these sequences attends to in all (each its own new one too)."""
    return sum(s.positions_used + 1 for s in decodes)
