"""Speculative decoding's proposals (n-gram prompt lookup, or a count for the agents' draft
model) and how much each sequence gets. Pure logic, like the batching policy that asks for them
(scheduler/batch_scheduler.py).

    proposer = Speculator(settings)                     # runtime.speculation
    proposal = proposer.propose(seq, k)                # ngram: the tokens that followed the latest
                                                       # earlier occurrence; draft: k (the agent's
                                                       # draft model proposes them)
    proposer.verified(seq, proposed, kept)             # its acceptance steers its next proposals

Prompt lookup: the sequence's last n tokens (n from ngram_max down to ngram_min) are looked up in
its own prompt and answer; the tokens that followed their latest earlier occurrence are proposed.
Answers that copy from the prompt (summaries, extraction, edits of a document, code) keep most of
them. The lookup is an index of every n-gram's latest end, kept up to date as tokens arrive: a
proposal costs O(n), not a scan of the sequence. A long prompt is indexed newest first over a few
steps (scheduler/ngram.py: bounded work a step on the scheduler loop), and only its latest ends
are held (bounded memory).

A sequence whose proposals keep failing proposes less often: after a step that kept none, it skips
1, then 2, 4... up to MAX_SKIP steps before proposing again; a step that keeps one resets it.
"""

from __future__ import annotations

from agent.contract.step import Proposal
from config.schema import SpeculationSection
from scheduler.ngram import NgramIndex, SpeculationState
from scheduler.sequence import Sequence

MAX_SKIP = 16


class Speculator:
    def __init__(self, settings: SpeculationSection):
        self.settings = settings

    @property
    def enabled(self) -> bool:
        return self.settings.method != "none"

    def propose(self, seq: Sequence, k: int) -> Proposal:
        """At most k tokens proposed after the sequence's pending token, or with a draft model k,
        the number it is to propose (none while the sequence backs off)."""
        state = seq.speculation
        if state is None:
            state = seq.speculation = SpeculationState(
                NgramIndex(self.settings.ngram_min, self.settings.ngram_max), list(seq.prompt)
            )
        if state.skip:
            state.skip -= 1
            return []
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
        if kept:
            state.skip, state.backoff = 0, 1
        else:
            state.skip, state.backoff = state.backoff, min(2 * state.backoff, MAX_SKIP)
