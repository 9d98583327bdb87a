"""The draft model of speculative decoding (runtime.speculation method draft): a second, smaller
model in the agent's process whose greedy tokens are proposed after a decoding sequence's pending
token, for the model to verify in its step (StepRequest.drafts, ModelRunner.execute).

    drafter = Drafter(draft_runner, target)        # check_vocabularies() first
    proposed = drafter.propose({slot: k}, tables)  # slot -> k greedy tokens of the draft

The draft keeps its own KV cache with the target's pool layout and reads and writes it through the
target's block tables: a block holds the same positions of the same tokens in both caches, so a
block the target shares (a prefix-cache hit) holds the draft's KV of those tokens or is written
with exactly that. Per slot the draft knows which tokens its positions hold, and for which of the
target's sequences (the target's slot state: a slot taken anew, after a release, is another
sequence); before proposing it computes the target's tokens past the longest prefix they share
(those kept since its last proposal, or all of them for a sequence new to it), which gives its
first proposal, then decodes the rest of them greedily, the slots of one step in one batch. A
slot whose tokens the target does not know (its KV imported from a prefill agent) gets none.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.model.tokenizer import load_tokenizer
from agent.runner import BlockTable, ModelRunner, SlotState

GREEDY = SamplingParams()


class DraftMismatch(ValueError):
    """A draft model that cannot propose the model's tokens (another vocabulary)."""


def check_vocabularies(model: Path, draft: Path) -> None:
    """The draft must speak the model's token ids: the same vocabulary, id for id; else
    DraftMismatch naming the first difference."""
    mine, theirs = (load_tokenizer(p).tokenizer.get_vocab(with_added_tokens=True) for p in (model, draft))
    if mine == theirs:
        return
    if len(mine) != len(theirs):
        detail = f"{len(theirs)} tokens, the model's {len(mine)}"
    else:
        by_id = {i: t for t, i in mine.items()}
        first = min(i for t, i in theirs.items() if by_id.get(i) != t)
        theirs_by_id = {i: t for t, i in theirs.items()}
        detail = f"token {first} is {theirs_by_id[first]!r} there, {by_id.get(first)!r} in the model"
    raise DraftMismatch(
        f"runtime.speculation.draft_model {draft}: its vocabulary is not the model's ({detail}); "
        f"a draft model must share the model's tokenizer"
    )


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class Drafter:
    def __init__(self, runner: ModelRunner, target: ModelRunner):
        """`runner`: the draft model's, beside `target`'s; both keep their slots' token ids."""
        self.runner, self.target = runner, target
        runner.slot_table.track_tokens = target.slot_table.track_tokens = True
        self.sequences: dict[int, SlotState] = {}  # slot -> the target's sequence its KV is of

    def propose(self, counts: Mapping[int, int], tables: Mapping[int, BlockTable]) -> dict[int, list[int]]:
        """Up to counts[slot] greedy tokens of the draft after each slot's pending token, written
        through `tables` (the step's, which cover the proposals' positions); a slot the target
        holds no tokens of, or without room for them, gets none."""
        proposed: dict[int, list[int]] = {}
        for slot, k in counts.items():
            known = self.target.slot_table.known_tokens(slot)
            if known is None or k < 1 or len(known) + k > self.runner.max_len:
                continue
            same = self.sequences.get(slot) is self.target.slots[slot] and slot in self.runner.slots
            held = self.runner.slots[slot].tokens if same else None
            self.sequences[slot] = self.target.slots[slot]
            # graphs without chunked prefill compute a prompt in one call from its start
            start = 0
            if self.runner.chunked_prefill:
                start = min(shared_prefix(held or [], known), len(known) - 1)
            self.runner.release(slot)  # taken anew: what it holds past `start` is written over
            prompt = StepChunk(slot, known, tables[slot], start, GREEDY)
            (first,) = self.runner.execute(StepRequest(chunks=[prompt])).firsts
            assert first is not None  # a chunk with sampling parameters samples
            proposed[slot] = [first.token]
        while True:
            slots = [s for s, tokens in proposed.items() if len(tokens) < counts[s]]
            if not slots:
                return proposed
            reply = self.runner.execute(StepRequest(slots=slots, tables=[tables[s] for s in slots]))
            for slot, (sampled,) in zip(slots, reply.decoded):
                proposed[slot].append(sampled.token)
