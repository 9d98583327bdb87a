"""One agent step, one type from the engine through the wire to the graphs.

StepRequest: decode `slots` (each with its block table), the prompt `chunks` (StepChunk), the
tokens proposed after decode slots' pending tokens (`drafts`), token masks (structured output) and,
for a prefill agent's whole prompt, where its KV goes (KVTransfer). A decode alone, a prompt chunk
alone and both together are one operation (protocol.py `step`); the agent runs the graph it needs.
StepReply: each decode slot's tokens and each chunk's first token. Both go to and come from the wire
with to_wire()/from_wire(); from_wire() checks every field a peer sent (types and shapes; the runner
checks slots, positions and token ids against its own bounds). StepLimits: what one mixed step may
hold, the one rule the scheduler plans by and the runner enforces.

A chunk computes positions start..len(tokens)-1 of a slot's sequence (`tokens`: its ids from
position 0; the positions before `start` are in the blocks of `table` already: earlier chunks, a
prefix-cache hit) into the blocks of `table`. The prompt's last chunk samples its first token with
`sampling`; the chunks before it have none and sample nothing.

A chunk with `prompt_logprobs` k (computed alone, in a prefill step: never mixed) also scores its
prompt positions (agent/contract/prompt_logprobs.py): row p's logits at token p + 1 for its rows
start..len(tokens)-2, and its last row's at `lookahead` (the prompt's token after the chunk) where
the chunk does not end the prompt; the reply carries these `scores` entries per chunk.

A scored chunk is a decoding slot's pending token and the tokens proposed after it (speculative
decoding), built by the agent from a step's `drafts`, never sent: `tokens` are those rows' ids alone
(position `start` on), and every row's logits are computed, to verify each proposal with the slot's
own sampler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.contract.sampling import MAX_LOGPROBS, SamplingParams

MAX_DRAFT_TOKENS = 16  # tokens proposed for one slot in one step (speculative decoding)
MAX_TIER_MOVES = 1 << 16  # blocks one step spills or restores (the prefix cache's second tier)

# Speculative decoding's proposal for one decoding slot of a step (`drafts`): the tokens proposed
# after its pending token (the server's n-gram lookup), or how many of them the agent's draft model
# is to propose (runtime.speculation method draft).
Proposal = list[int] | int

# A sequence's blocks, position p in block table[p // block_size].
BlockTable = Sequence[int] | np.ndarray

TokenMasks = Mapping[int, np.ndarray]  # slot -> the tokens its next token may be (int32 bit words)


def proposal_size(proposal: Proposal) -> int:
    return proposal if isinstance(proposal, int) else len(proposal)


@dataclass(frozen=True)
class StepLimits:
    """What one mixed step (decode rows and prompt chunks in one graph call) may hold: `mixed_rows`
    rows (the agent's info; 0: it runs none) and `max_batch` sequences and rows of logits (its
    largest decode batch bucket). Rows: each decode slot's pending token, the tokens proposed after
    it, each chunk's positions; rows of logits: the decode rows, the proposals, one per sampling
    chunk."""

    mixed_rows: int
    max_batch: int

    def refusal(self, decodes: int, proposed: int, chunk_rows: Sequence[int], sampled: int) -> str | None:
        """Why such a step does not fit, or None when it does."""
        rows = decodes + proposed + sum(chunk_rows)
        seqs, logits = decodes + len(chunk_rows), decodes + proposed + sampled
        if rows <= self.mixed_rows and seqs <= self.max_batch and logits <= self.max_batch:
            return None
        return (
            f"a mixed step of {rows} rows, {seqs} sequences and {logits} rows of logits exceeds "
            f"{self.mixed_rows} rows or {self.max_batch} sequences and rows of logits"
        )

    def fits(self, decodes: int, proposed: int, chunk_rows: Sequence[int], sampled: int) -> bool:
        return self.refusal(decodes, proposed, chunk_rows, sampled) is None

    def proposal_room(self, decodes: int) -> int:
        """Tokens that may be proposed after `decodes` decode rows, one logit row left for a
        prompt's first token."""
        return min(self.max_batch - 1, self.mixed_rows) - decodes

    def prompt_rows(self, decodes: int, proposed: int) -> int:
        """Prompt positions that fit beside `decodes` decode rows and `proposed` proposals."""
        return self.mixed_rows - decodes - proposed


@dataclass(frozen=True)
class StepChunk:
    slot: int
    tokens: Sequence[int]
    table: BlockTable
    start: int
    sampling: SamplingParams | None = None  # the prompt's last chunk: it samples with these
    scored: bool = False  # a decoding slot's pending token and its proposals (see above)
    prompt_logprobs: int | None = None  # k: score its prompt positions (see above)
    lookahead: int | None = None  # with prompt_logprobs: the prompt's token after the chunk
    # Gated DeltaNet layers (Qwen3.5's): the snapshot its state starts from (a prefix-cache hit's
    # end) and the snapshot its state is saved into after it (scheduler/state_snapshots.py)
    restore: int | None = None
    save: int | None = None

    @property
    def scores(self) -> int:
        """The prompt positions it scores: one per row but the last, which scores `lookahead`."""
        if self.prompt_logprobs is None:
            return 0
        return len(self.tokens) - self.start - 1 + (self.lookahead is not None)

    @property
    def sample(self) -> bool:
        return self.sampling is not None

    @property
    def new_tokens(self) -> Sequence[int]:
        """The ids of the positions this chunk computes."""
        return self.tokens if self.scored else self.tokens[self.start :]

    def to_wire(self) -> dict[str, Any]:
        """The chunk's header map (its sampling only where it samples); its tokens and table travel
        as arrays of their own (StepRequest.to_wire)."""
        fields: dict[str, Any] = {"slot": self.slot, "start": self.start, "sample": self.sample}
        if self.sampling is not None:
            fields["sampling"] = self.sampling.model_dump()
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = [self.prompt_logprobs, self.lookahead]
        if self.restore is not None:
            fields["restore"] = self.restore
        if self.save is not None:
            fields["save"] = self.save
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
        # The wire check, not an API rule: the server validated the request where it entered, but
        # the agent takes no peer's word for it (a hostile or buggy peer).
        sampling = SamplingParams.model_validate(spec["sampling"]) if spec["sample"] else None
        k, lookahead = _prompt_logprobs(spec.get("prompt_logprobs"))
        restore, save = spec.get("restore"), spec.get("save")
        for name, value in (("restore", restore), ("save", save)):
            if value is not None and (type(value) is not int or not 0 <= value < 2**31):
                raise ValueError(f"a chunk's {name} is a snapshot slot (an integer >= 0), got {value!r}")
        return cls(
            slot,
            tokens.tolist(),
            table,
            start,
            sampling,
            prompt_logprobs=k,
            lookahead=lookahead,
            restore=restore,
            save=save,
        )


@dataclass(frozen=True)
class KVTransfer:
    """Where a prefill agent sends a prompt's KV (PD disaggregation): the decode agent's address,
    the slot and block table there, its session and the transfer's ticket (kv_receive)."""

    address: str
    slot: int
    session: int
    ticket: int
    table: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "slot": self.slot,
            "session": self.session,
            "ticket": self.ticket,
            "table": list(self.table),
        }

    @classmethod
    def from_wire(cls, value: Any) -> KVTransfer:
        """The inverse of to_wire(); ValueError for anything else."""
        if not isinstance(value, dict):
            raise ValueError("transfer must be a map")
        address, table = value.get("address"), value.get("table")
        if not isinstance(address, str):
            raise ValueError("transfer.address must be the decode agent's address")
        if not isinstance(table, list) or not all(type(b) is int and 0 <= b < 2**31 for b in table):
            raise ValueError("transfer.table must be the decode agent's block table (integers)")
        slot, session, ticket = (_int_field(value, f"transfer.{n}", n) for n in ("slot", "session", "ticket"))
        return cls(address, slot, session, ticket, tuple(table))

    def receive_fields(self, state: dict) -> dict[str, Any]:
        """The kv_receive request's fields for the decode agent, with the slot's state."""
        return {"slot": self.slot, "session": self.session, "ticket": self.ticket, "state": state}


@dataclass(frozen=True)
class StepRequest:
    """One agent step: a decode of `slots` (each with its block table, covering its next position
    and its proposals'), the prompt `chunks`, `drafts` (decode slot -> its Proposal), `masks` (slot
    -> its next token's mask; decode slots and sampling chunks) and, for a prefill agent's whole
    prompt alone, `transfer`."""

    slots: Sequence[int] = ()
    tables: Sequence[BlockTable] = ()
    chunks: Sequence[StepChunk] = ()
    masks: TokenMasks = field(default_factory=dict)
    drafts: Mapping[int, Proposal] = field(default_factory=dict)
    transfer: KVTransfer | None = None
    # the prefix cache's second tier (agent/kv_tiers.py), both before anything computes: (block,
    # digest) to copy out of the pool, then (digest, block) to read back into it
    spill: Sequence[tuple[int, str]] = ()
    restore: Sequence[tuple[str, int]] = ()

    @property
    def kind(self) -> str:
        """What the step runs: "decode" (decode slots alone), "prefill" (prompt chunks alone) or
        "mixed" (both in one call, or proposals to verify): the metrics' `op` label."""
        if self.chunks and not self.slots:
            return "prefill"
        return "mixed" if self.chunks or self.drafts else "decode"

    def to_wire(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The request's header fields and arrays: decode slots, their block tables, each chunk's
        tokens and table, then the masks (protocol.py `step`)."""
        arrays = [np.asarray(self.slots, np.int32), block_tables(self.tables)]
        for chunk in self.chunks:
            arrays += [np.asarray(chunk.tokens, np.int32), np.asarray(chunk.table, np.int32)]
        fields: dict[str, Any] = {"chunks": [c.to_wire() for c in self.chunks]}
        if self.drafts:
            fields["drafts"] = [[s, p if isinstance(p, int) else list(p)] for s, p in self.drafts.items()]
        if self.transfer is not None:
            fields["transfer"] = self.transfer.to_wire()
        if self.spill:
            fields["spill"] = [[b, d] for b, d in self.spill]
        if self.restore:
            fields["restore"] = [[d, b] for d, b in self.restore]
        if self.masks:
            fields["masked"] = list(self.masks)
            arrays.append(np.stack([self.masks[s] for s in self.masks]).astype(np.int32))
        return fields, arrays

    @classmethod
    def from_wire(cls, header: dict[str, Any], arrays: list[np.ndarray], max_chunks: int) -> StepRequest:
        """The inverse of to_wire(), every field checked for type and shape; ValueError (or
        pydantic's, for a chunk's sampling) for anything else."""
        arrays, masks = _token_masks(header, arrays)
        specs = header.get("chunks")
        if not isinstance(specs, list) or len(specs) > max_chunks:
            raise ValueError(f"step takes a list of up to {max_chunks} chunks")
        if len(arrays) != 2 + 2 * len(specs) or arrays[1].ndim != 2 or arrays[1].dtype.kind != "i":
            raise ValueError(
                "step takes decode slot ids [n], their block tables [n, blocks], then tokens and a block "
                "table per chunk"
            )
        (slots,) = _int_arrays(arrays[:1], ("slot ids",))
        if len(arrays[1]) != len(slots):
            raise ValueError(f"step decodes {len(slots)} slots with {len(arrays[1])} block tables")
        chunks = [
            StepChunk.from_wire(
                spec, *_int_arrays(arrays[2 + 2 * i : 4 + 2 * i], ("token ids", "block table"))
            )
            for i, spec in enumerate(specs)
        ]
        drafts = _drafts(header)
        if not (chunks or len(slots)):
            raise ValueError("a step decodes slots, computes prompt chunks, or both")
        transfer = KVTransfer.from_wire(header["transfer"]) if "transfer" in header else None
        if transfer is not None and (len(slots) or len(chunks) != 1 or not chunks[0].sample):
            raise ValueError("a step that sends its KV computes one whole prompt alone (sample: true)")
        spill = [(b, d) for d, b in _tier_moves(header, "spill", swapped=True)]
        restore = _tier_moves(header, "restore")
        return cls(slots.tolist(), list(arrays[1]), chunks, masks, drafts, transfer, spill, restore)


def block_tables(tables: Sequence[BlockTable]) -> np.ndarray:
    """Rows of block ids as one int32 array, padded with -1 to the longest (the agent reads only
    the blocks of each row's positions, and refuses -1 among them)."""
    width = max((len(t) for t in tables), default=0)
    out = np.full((len(tables), width), -1, np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


def _token_masks(header: dict, arrays: list) -> tuple[list, dict[int, np.ndarray]]:
    """A request's arrays without its token masks, and the masks by slot: header `masked` lists
    the slots, the last array holds their masks [len(masked), words] (the runner checks the rest)."""
    masked = header.get("masked")
    if masked is None:
        return arrays, {}
    if (
        not isinstance(masked, list)
        or not masked
        or not all(type(s) is int for s in masked)
        or len(set(masked)) != len(masked)
    ):
        raise ValueError("field 'masked' must list distinct slot ids")
    if not arrays or arrays[-1].ndim != 2 or arrays[-1].dtype != np.int32 or len(arrays[-1]) != len(masked):
        raise ValueError("token masks: an int32 array [masked slots, words] after the other arrays")
    return arrays[:-1], dict(zip(masked, arrays[-1]))


def _drafts(header: dict) -> dict[int, Proposal]:
    """A step's `drafts`: [[slot, [token, ...]], ...] (the server's proposals) or [[slot, k], ...]
    (k tokens the draft model proposes); the runner checks the slots and tokens."""
    drafts = header.get("drafts", [])
    if not isinstance(drafts, list) or not all(
        isinstance(d, list)
        and len(d) == 2
        and type(d[0]) is int
        and (type(d[1]) is int or (isinstance(d[1], list) and all(type(t) is int for t in d[1])))
        for d in drafts
    ):
        raise ValueError("field 'drafts' must list [slot, [token ids]] or [slot, count] pairs")
    found = dict(drafts)
    if len(found) != len(drafts):
        raise ValueError("field 'drafts' names a slot twice")
    return found


def _tier_moves(header: dict, name: str, swapped: bool = False) -> list[tuple[str, int]]:
    """A step's `restore` ([[digest, block], ...]) or, `swapped`, `spill` ([[block, digest], ...]),
    as (digest, block) pairs; a digest is 64 lowercase hex digits (the runner checks the blocks)."""
    moves = header.get(name, [])
    if not isinstance(moves, list) or len(moves) > MAX_TIER_MOVES:
        raise ValueError(f"field {name!r} must list at most {MAX_TIER_MOVES} pairs")
    out = []
    for move in moves:
        if not isinstance(move, list) or len(move) != 2:
            raise ValueError(f"field {name!r} must list [block, digest] or [digest, block] pairs")
        digest, block = reversed(move) if swapped else move
        if type(block) is not int or not 0 <= block < 2**31 or not _is_digest(digest):
            raise ValueError(f"field {name!r}: a block id and a digest of 64 lowercase hex digits")
        out.append((digest, block))
    return out


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _prompt_logprobs(value: Any) -> tuple[int | None, int | None]:
    """A chunk's `prompt_logprobs` field: absent, or [k, lookahead token id or null] (the runner
    checks the token against its vocabulary)."""
    if value is None:
        return None, None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or type(value[0]) is not int
        or not 0 <= value[0] <= MAX_LOGPROBS
        or not (value[1] is None or (type(value[1]) is int and value[1] >= 0))
    ):
        raise ValueError(f"a chunk's prompt_logprobs is [k (0..{MAX_LOGPROBS}), lookahead token id or null]")
    return value[0], value[1]


def _int_field(fields: dict[str, Any], label: str, name: str | None = None) -> int:
    value = fields.get(name or label)
    if type(value) is not int:
        raise ValueError(f"field {label!r} must be an integer, got {value!r:.50}")
    return value


def _int_arrays(arrays: list, what: tuple[str, ...]) -> list[np.ndarray]:
    if len(arrays) != len(what) or any(a.ndim != 1 or a.dtype.kind != "i" for a in arrays):
        raise ValueError(f"step takes {len(what)} 1-D integer arrays: {', '.join(what)}")
    return arrays
