"""Speculative decoding's proposals (n-gram prompt lookup, or a count for the agents' draft
model) and how much each sequence gets. Pure logic, like the batching policy that asks for them
(scheduler/batch_scheduler.py).

    proposer = Speculator(settings)                     # runtime.speculation
    if not proposer.rests(seq):                        # backing off after proposals that failed
        proposal = proposer.propose(seq, k)            # ngram: the tokens that followed the latest
                                                       # earlier occurrence; draft: k (the agent's
                                                       # draft model proposes them)
    proposer.verified(seq, proposed, kept)             # its acceptance steers its next proposals

Prompt lookup: the sequence's last n tokens (n from ngram_max down to ngram_min) are looked up in
its own prompt and answer; the tokens that followed their latest earlier occurrence are proposed.
Answers that copy from the prompt (summaries, extraction, edits of a document, code) keep most of
them. The lookup is an index of every n-gram's latest end, kept up to date as tokens arrive: a
proposal costs O(n), not a scan of the sequence. A long prompt is indexed newest first over a few
steps (scheduler/speculation/ngram.py: bounded work a step on the scheduler loop), and only its latest ends
are held (bounded memory).

How many tokens each sequence proposes (k, at most num_tokens) is chosen per step from its
acceptance and the group's learned step costs (scheduler/speculation/proposal_length.py): k = 0 where no token
pays. A sequence whose proposals keep failing also rests: after a step that kept none, it skips 1,
then 2, 4... up to MAX_SKIP steps before proposing again; a step that keeps one resets it. Resting
bounds how often a failing sequence probes, and its acceptance drifts back to the prior meanwhile,
so one whose answer starts copying later proposes again (where the prior pays).
"""

from __future__ import annotations

import sys

from agent.contract.step import Proposal
from config.schema import SpeculationSection
from scheduler.sequence import Sequence
from scheduler.speculation.ngram import NgramIndex, SpeculationState
from scheduler.speculation.proposal_length import acceptance, age, observe

MAX_SKIP = 16
DRAFT_MAX_BATCH = 4  # a draft model's cost is not modelled: it proposes only while few decode


class Speculator:
    def __init__(self, settings: SpeculationSection):
        self.settings = settings

    @property
    def enabled(self) -> bool:
        return self.settings.method != "none"

    @property
    def max_batch(self) -> int:
        """Sequences decoding in a group beyond which nothing is proposed."""
        if self.settings.max_batch is not None:
            return self.settings.max_batch
        return DRAFT_MAX_BATCH if self.settings.method == "draft" else sys.maxsize

    def state(self, seq: Sequence) -> SpeculationState:
        """The sequence's speculation state, made at its first use."""
        if seq.speculation is None:
            seq.speculation = SpeculationState(
                NgramIndex(self.settings.ngram_min, self.settings.ngram_max), list(seq.prompt)
            )
        return seq.speculation

    def rests(self, seq: Sequence) -> bool:
        """Whether the sequence proposes nothing this step, backing off (counts the step); each
        step ages its acceptance."""
        state = self.state(seq)
        age(state)
        if state.skip:
            state.skip -= 1
            return True
        return False

    def acceptance(self, seq: Sequence) -> float:
        return acceptance(self.state(seq))

    def propose(self, seq: Sequence, k: int) -> Proposal:
        """At most k tokens proposed after the sequence's pending token, or with a draft model k,
        the number it is to propose."""
        state = self.state(seq)
        if self.settings.method == "draft":
            return k
        tokens = state.tokens  # an answer only grows: its new tokens, not the whole copied each step
        tokens += seq.output[len(tokens) - len(seq.prompt) :]
        state.index.update(tokens)
        return state.index.propose(tokens, k)

    def verified(self, seq: Sequence, proposed: int, kept: int) -> None:
        state = seq.speculation
        if state is None or not proposed:
            return
        state.proposed += proposed
        state.kept += kept
        observe(state, proposed, kept)
        if kept:
            state.skip, state.backoff = 0, 1
        else:
            state.skip, state.backoff = state.backoff, min(2 * state.backoff, MAX_SKIP)
