"""Drafts: the tokens proposed after decoding sequences' pending tokens (speculative decoding), as
the BatchScheduler plans them, and the counts of what the agents kept. The proposals themselves come
from the Speculator (scheduler/speculation/speculator.py)."""

from __future__ import annotations

from agent.contract.step import proposal_size
from scheduler.block_manager import BlockManager
from scheduler.plan import GroupCapacity, StepPlan
from scheduler.sequence import Sequence
from scheduler.speculation.proposal_length import choose_lengths
from scheduler.speculation.speculator import Speculator
from scheduler.speculation.verify_costs import VerifyCosts


class Drafts:
    def __init__(self, speculator: Speculator | None = None):
        self.speculator = speculator  # proposes tokens for decoding sequences
        self.proposed_tokens = 0  # cumulative: tokens proposed
        self.accepted_tokens = 0  # of those, kept by the agents
        self.speculative_steps = 0  # a sequence's step that verified proposals: accepted per step

    def plan(
        self,
        capacity: GroupCapacity,
        blocks: BlockManager,
        decodes: list[Sequence],
        plan: StepPlan,
        costs: VerifyCosts | None = None,
    ) -> None:
        """Tokens proposed after the group's decoding sequences' pending tokens, within the logit
        rows of one mixed call (one left for a prompt's first token), each with the blocks of their
        positions: free blocks only, a proposal never preempts. With n-gram lookup each sequence
        proposes as many as pay for themselves, from its acceptance and what proposals cost the
        group's steps (`costs`, scheduler/speculation/proposal_length.py); a draft model num_tokens. A
        constrained sequence proposes only tokens its constraint leaves free (a grammar's mask
        holds for one token: none; a thinking budget: those before it is spent), and one whose
        request opted out nothing."""
        speculator = self.speculator
        if speculator is None or not speculator.enabled or not capacity.max_proposals:
            return
        if len(decodes) > speculator.max_batch:
            return
        room = capacity.limits.proposal_room(len(decodes))
        if room <= 0:
            return
        wanting: list[tuple[Sequence, int]] = []  # the sequences that may propose, and their most
        for seq in decodes:
            free = None if seq.constraint is None else seq.constraint.free_tokens
            if not seq.speculate or free == 0 or speculator.rests(seq):
                continue
            limit = min(
                speculator.settings.num_tokens,
                capacity.max_proposals,
                room,
                seq.max_new_tokens - len(seq.output) - 1,  # the step's last token is always its own
                capacity.max_seq_len - 1 - seq.computed,
                room if free is None else free - 1,  # the step samples k + 1, all free
            )
            if limit > 0:
                wanting.append((seq, limit))
        if speculator.settings.method == "draft" or not speculator.settings.adaptive:
            lengths = [limit for _, limit in wanting]  # (a draft model's own cost is not modelled)
        else:
            lengths = choose_lengths(costs, len(decodes), [(speculator.acceptance(s), k) for s, k in wanting])
        for (seq, _), k in zip(wanting, lengths):
            k = min(k, room)
            proposed = speculator.propose(seq, k) if k > 0 else []
            size = proposal_size(proposed)
            if size and blocks.append(seq.request_id, seq.computed + 1 + size):
                plan.drafts[seq.request_id] = proposed
                room -= size

    def verified(self, seq: Sequence, proposed: int, kept: int) -> None:
        """The sequence's agent kept `kept` of its `proposed` tokens."""
        if self.speculator is None:
            return
        self.speculator.verified(seq, proposed, kept)
        self.proposed_tokens += proposed
        self.accepted_tokens += kept
        self.speculative_steps += 1
