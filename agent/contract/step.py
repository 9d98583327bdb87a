"""StepChunk: a prompt chunk of a step, one type from the engine through the wire to the graphs.

A chunk computes positions start..len(tokens)-1 of a slot's sequence (`tokens`: its ids from
position 0; the positions before `start` are in the blocks of `table` already: earlier chunks, a
prefix-cache hit) into the blocks of `table`. The prompt's last chunk samples its first token with
`sampling`; the chunks before it have none and sample nothing.

A scored chunk is a decoding slot's pending token and the tokens proposed after it (speculative
decoding), built by the agent from a step's `drafts`, never sent: `tokens` are those rows' ids alone
(position `start` on), and every row's logits are computed, to verify each proposal with the slot's
own sampler.

On the wire (agent/contract/protocol.py: `step`'s `chunks`) a chunk is the map to_wire() writes, its
tokens and its table travelling as arrays of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.contract.sampling import SamplingParams

# Speculative decoding's proposal for one decoding slot of a step (`drafts`): the tokens proposed
# after its pending token (the server's n-gram lookup), or how many of them the agent's draft model
# is to propose (runtime.speculation method draft).
Proposal = list[int] | int


def proposal_size(proposal: Proposal) -> int:
    return proposal if isinstance(proposal, int) else len(proposal)


@dataclass(frozen=True)
class StepChunk:
    slot: int
    tokens: Sequence[int]
    table: Sequence[int] | np.ndarray
    start: int
    sampling: SamplingParams | None = None  # the prompt's last chunk: it samples with these
    scored: bool = False  # a decoding slot's pending token and its proposals (see above)

    @property
    def sample(self) -> bool:
        return self.sampling is not None

    @property
    def new_tokens(self) -> Sequence[int]:
        """The ids of the positions this chunk computes."""
        return self.tokens if self.scored else self.tokens[self.start :]

    def to_wire(self) -> dict[str, Any]:
        """The chunk's header map (its sampling only where it samples)."""
        fields: dict[str, Any] = {"slot": self.slot, "start": self.start, "sample": self.sample}
        if self.sampling is not None:
            fields["sampling"] = self.sampling.model_dump()
        return fields

    @classmethod
    def from_wire(cls, spec: Any, tokens: np.ndarray, table: np.ndarray) -> StepChunk:
        """The inverse of to_wire() with the chunk's arrays; ValueError (or pydantic's) for anything
        else."""
        if not isinstance(spec, dict) or not isinstance(spec.get("sample"), bool):
            raise ValueError("a chunk is a map with slot, start, sample (true or false) and its sampling")
        slot, start = spec.get("slot"), spec.get("start")
        if type(slot) is not int or type(start) is not int:
            raise ValueError(f"a chunk's slot and start are integers, got {slot!r} and {start!r}")
        if spec["sample"] != ("sampling" in spec):
            raise ValueError("a chunk carries its sampling when it samples, and only then")
        sampling = SamplingParams.model_validate(spec["sampling"]) if spec["sample"] else None
        return cls(slot, tokens.tolist(), table, start, sampling)
