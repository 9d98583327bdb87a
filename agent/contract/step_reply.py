"""StepReply: what one agent step (agent/contract/step.py StepRequest) answers.

On the wire (protocol.py `step`): one int32 array of the decode slots' tokens, slot after slot,
`counts` (each decode slot's number of tokens: one, or with proposals the ones kept and one more),
`chunk_tokens` (each chunk's first token, null unless it samples), and where any entry is not null
`logprobs` and `errors` (one per decode token), `chunk_logprobs` and `chunk_errors` (one per chunk);
a step that sent its KV adds kv_bytes and transfer_ms; where a chunk scores its prompt positions,
`chunk_prompt_logprobs` holds per chunk its entries (StepChunk.scores of them) or null; where a
pooling chunk (its sampling's `pool`) returns its vector, `chunk_pooled` says per chunk whether one
follows the tokens array as an array of its own (float32);
`restore_failed` lists the digests of the request's `restore` that the tier no longer had (their
blocks hold no valid KV: the scheduler recomputes from there); a step that moved tier blocks adds
`tier` (TierReport: what the agent's store counted since its last report, its bytes, the restore time,
and the keys it let go since then, which the scheduler's index of tier blocks then forgets).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.contract.prompt_logprobs import PromptLogprob
from agent.contract.sampling import NO_TOKEN, Sampled, SequenceFault, TokenLogprob
from agent.contract.step import StepRequest, proposal_size

# What a KV tier store counts (agent/kv_tiers.py), in blocks: restores served from host memory and
# from disk, restores it no longer had, files it would not load, writes the full disk queue dropped,
# files written, files evicted for room.
TIER_COUNTS = ("host_hits", "disk_hits", "misses", "ignored_files", "dropped_writes", "written", "evicted")
_LARGEST_COUNT = 1 << 48
# Keys a TierReport names as let go, at most (64 hex digits each: 256 KiB); the store keeps the rest
# for its next report
MAX_REPORTED_EVICTIONS = 1 << 12
_LONGEST_KEY = 128
MAX_HIDDEN_SIZE = 1 << 16  # a pooled hidden state's elements, at most


@dataclass(frozen=True)
class TierReport:
    """An agent's KV tier after a step that spilled or restored blocks: its counts since its
    previous report (TIER_COUNTS), the bytes each tier holds now, the step's restore time, and the
    keys it let go since its previous report (held in neither tier any more: least recently used
    out, a write dropped, a corrupt file)."""

    counts: Mapping[str, int]
    host_bytes: int
    disk_bytes: int
    restore_s: float
    evicted_keys: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "restore_ms": round(self.restore_s * 1000, 3),
            "evicted_keys": list(self.evicted_keys),
        }

    @classmethod
    def from_wire(cls, entry: Any) -> TierReport:
        """ValueError where it is not one (unknown counts, values that are not sizes)."""
        if not isinstance(entry, dict) or not isinstance(entry.get("counts"), dict):
            raise ValueError("step reply's tier is not a map with its counts")
        counts, restore_ms = entry["counts"], entry.get("restore_ms")
        sizes = [*counts.values(), entry.get("host_bytes"), entry.get("disk_bytes")]
        if (
            not set(counts) <= set(TIER_COUNTS)
            or not all(type(n) is int and 0 <= n < _LARGEST_COUNT for n in sizes)
            or not isinstance(restore_ms, (int, float))
            or not (math.isfinite(restore_ms) and 0 <= restore_ms < 1e9)
        ):
            raise ValueError("step reply's tier holds unknown counts or values that are not sizes")
        evicted = entry.get("evicted_keys", [])
        if (
            not isinstance(evicted, list)
            or len(evicted) > MAX_REPORTED_EVICTIONS
            or not all(isinstance(k, str) and 0 < len(k) <= _LONGEST_KEY for k in evicted)
        ):
            raise ValueError(f"step reply's tier names more than {MAX_REPORTED_EVICTIONS} keys, or not keys")
        return cls(
            {name: counts.get(name, 0) for name in TIER_COUNTS},
            entry["host_bytes"],
            entry["disk_bytes"],
            restore_ms / 1000,
            tuple(evicted),
        )


@dataclass(frozen=True)
class StepReply:
    decoded: list[list[Sampled]]  # each decode slot's tokens, in the request's order
    firsts: list[Sampled | None]  # each chunk's first token; None where it does not sample
    kv_bytes: int = 0  # a step that sent its KV (KVTransfer): the K/V bytes sent
    transfer_ms: float = 0.0  # and how long the sending took
    # each chunk's prompt logprobs (StepChunk.prompt_logprobs), None where it asked none; empty:
    # no chunk asked
    prompts: Sequence[Sequence[PromptLogprob] | None] = ()
    restore_failed: Sequence[str] = ()
    tier: TierReport | None = None  # a step that spilled or restored tier blocks
    # each chunk's pooled vector (its sampling's pool), None where it asked none; empty: none did
    pooled: Sequence[np.ndarray | None] = ()

    def to_wire(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        tokens = [s for slot in self.decoded for s in slot]
        fields: dict[str, Any] = {
            "counts": [len(slot) for slot in self.decoded],
            "chunk_tokens": [None if s is None else s.token for s in self.firsts],
            **_entries(tokens, ""),
            **_entries(self.firsts, "chunk_"),
        }
        if self.kv_bytes:
            fields |= {"kv_bytes": self.kv_bytes, "transfer_ms": self.transfer_ms}
        if any(p is not None for p in self.prompts):
            fields["chunk_prompt_logprobs"] = [
                None if p is None else [e.to_wire() for e in p] for p in self.prompts
            ]
        if self.restore_failed:
            fields["restore_failed"] = list(self.restore_failed)
        if self.tier is not None:
            fields["tier"] = self.tier.to_wire()
        if self.pooled:
            fields["chunk_pooled"] = [p is not None for p in self.pooled]
        vectors = [np.asarray(p, np.float32) for p in self.pooled if p is not None]
        return fields, [np.asarray([s.token for s in tokens], np.int32), *vectors]

    @classmethod
    def from_wire(
        cls,
        header: dict[str, Any],
        arrays: list[np.ndarray],
        request: StepRequest,
        vocab_size: int | None,
        peer: str = "the agent",
    ) -> StepReply:
        """The reply to `request`. ValueError where it does not fit the request (the agent does not
        follow the protocol); a bad value for one token (not a token id of the vocabulary, a logprob
        that is not one) is that sequence's fault instead: it ends, the others go on."""
        if not arrays or arrays[0].ndim != 1:
            raise ValueError("step reply without its tokens array")
        tokens = arrays[0].tolist()
        counts, firsts = header.get("counts"), header.get("chunk_tokens")
        if (
            not isinstance(counts, list)
            or len(counts) != len(request.slots)
            or not all(
                type(n) is int and 1 <= n <= 1 + proposal_size(request.drafts.get(s, []))
                for s, n in zip(request.slots, counts)
            )
            or sum(counts) != len(tokens)
        ):
            raise ValueError("step reply's counts do not fit its tokens")
        if (
            not isinstance(firsts, list)
            or len(firsts) != len(request.chunks)
            or any((t is None) == c.sample for t, c in zip(firsts, request.chunks))
        ):
            raise ValueError("step reply without a token per sampling chunk")
        flat = _sampled(tokens, header, "", vocab_size, peer)
        decoded, at = [], 0
        for n in counts:
            decoded.append(flat[at : at + n])
            at += n
        chunk_firsts = [
            None if t is None else s
            for t, s in zip(firsts, _sampled(firsts, header, "chunk_", vocab_size, peer))
        ]
        prompts = _prompt_logprobs(header, request, vocab_size)
        failed = header.get("restore_failed", [])
        if (
            not isinstance(failed, list)
            or not all(isinstance(d, str) for d in failed)
            or not set(failed) <= {d for d, _ in request.restore}
        ):
            raise ValueError("step reply's restore_failed names digests its request did not restore")
        failed = tuple(failed)
        tier = None if header.get("tier") is None else TierReport.from_wire(header["tier"])
        pooled = _pooled(header.get("chunk_pooled"), arrays[1:], request, chunk_firsts)
        sent = request.transfer is not None and chunk_firsts[0] is not None and chunk_firsts[0].fault is None
        if not sent:
            return cls(
                decoded, chunk_firsts, prompts=prompts, restore_failed=failed, tier=tier, pooled=pooled
            )
        kv_bytes, transfer_ms = header.get("kv_bytes"), header.get("transfer_ms")
        if type(kv_bytes) is not int or not isinstance(transfer_ms, (int, float)):
            raise ValueError("step reply without the size and time of its KV transfer")
        return cls(decoded, chunk_firsts, kv_bytes, float(transfer_ms), prompts, failed, tier, pooled)


def _pooled(
    flags: Any, vectors: list[np.ndarray], request: StepRequest, firsts: Sequence[Sampled | None]
) -> Sequence[np.ndarray | None]:
    """Each chunk's pooled vector: one where it asked (its sampling's pool) and sampled, finite
    float32 of the pool's size (a hidden state: at most MAX_HIDDEN_SIZE); ValueError where the reply
    does not fit the request."""
    pools = [None if c.sampling is None else c.sampling.pool for c in request.chunks]
    if flags is None:
        if vectors or any(p is not None and s is not None and s.fault is None for p, s in zip(pools, firsts)):
            raise ValueError("step reply without the pooled vectors its chunks asked for")
        return ()
    if (
        not isinstance(flags, list)
        or len(flags) != len(request.chunks)
        or sum(f is True for f in flags) != len(vectors)
    ):
        raise ValueError("step reply's chunk_pooled do not fit its chunks and arrays")
    out: list[np.ndarray | None] = []
    given = iter(vectors)
    for pool, flag, first in zip(pools, flags, firsts):
        if flag is not True:
            if pool is not None and first is not None and first.fault is None:
                raise ValueError("step reply without a pooling chunk's vector")
            out.append(None)
            continue
        vector = next(given)
        size = len(pool) if isinstance(pool, tuple) else None
        if (
            pool is None
            or vector.dtype != np.float32
            or vector.ndim != 1
            or not 1 <= len(vector) <= MAX_HIDDEN_SIZE
            or (size is not None and len(vector) != size)
            or not np.isfinite(vector).all()
        ):
            raise ValueError("step reply's pooled vector is not the float32 vector its chunk asked for")
        out.append(vector)
    return out


def _prompt_logprobs(
    header: dict, request: StepRequest, vocab_size: int | None
) -> Sequence[list[PromptLogprob] | None]:
    """Each chunk's prompt logprobs: as many as it scores (StepChunk.scores) where it asked, else
    None (none at all where no chunk asked); ValueError where the reply does not fit the request."""
    asked = [c.prompt_logprobs is not None for c in request.chunks]
    entries = header.get("chunk_prompt_logprobs")
    if not any(asked) and entries is None:
        return ()
    if entries is None:
        if any(c.scores for c in request.chunks):
            raise ValueError("step reply without the prompt logprobs its chunks asked for")
        return [[] if a else None for a in asked]
    if not isinstance(entries, list) or len(entries) != len(request.chunks):
        raise ValueError("step reply's chunk_prompt_logprobs do not fit its chunks")
    out: list[list[PromptLogprob] | None] = []
    for chunk, given in zip(request.chunks, entries):
        if chunk.prompt_logprobs is None:
            if given is not None:
                raise ValueError("step reply has prompt logprobs for a chunk that asked none")
            out.append(None)
            continue
        if not isinstance(given, list) or len(given) != chunk.scores:
            raise ValueError(f"step reply's prompt logprobs of a chunk are not {chunk.scores} entries")
        parsed = [PromptLogprob.from_wire(e, vocab_size) for e in given]
        if any(len(e.top) > chunk.prompt_logprobs for e in parsed):
            raise ValueError("step reply has more top prompt logprobs than its chunk asked for")
        out.append(parsed)
    return out


def _entries(sampled: Sequence[Sampled | None], prefix: str) -> dict[str, list]:
    """The `logprobs` and `errors` fields of these tokens, each absent where all are null."""
    fields = {}
    for name, entries in (
        ("logprobs", [None if s is None else s.logprob for s in sampled]),
        ("errors", [None if s is None else s.fault for s in sampled]),
    ):
        if any(e is not None for e in entries):
            fields[prefix + name] = [None if e is None else e.to_wire() for e in entries]
    return fields


def _sampled(tokens: list, header: dict, prefix: str, vocab_size: int | None, peer: str) -> list[Sampled]:
    """The tokens with their entries of the reply's `logprobs` and `errors` fields (lists of an
    entry or null per token, or absent)."""
    lists = {name: header.get(prefix + name) for name in ("logprobs", "errors")}
    for name, entries in lists.items():
        if entries is not None and (not isinstance(entries, list) or len(entries) != len(tokens)):
            raise ValueError(
                f"its reply's {prefix}{name} do not fit its tokens "
                f"({len(entries) if isinstance(entries, list) else type(entries).__name__} for "
                f"{len(tokens)} tokens)"
            )
    logprobs, errors = lists["logprobs"], lists["errors"]
    return [
        sampled_from_wire(
            token,
            None if logprobs is None else logprobs[i],
            None if errors is None else errors[i],
            vocab_size,
            peer,
        )
        for i, token in enumerate(tokens)
    ]


def sampled_from_wire(token: Any, logprob: Any, error: Any, vocab_size: int | None, peer: str) -> Sampled:
    """One token of a reply with its logprob and error entries; a value that is not one is the
    fault of its sequence ("internal")."""
    if token is None:  # a chunk that samples nothing (checked against the request)
        return Sampled(NO_TOKEN)
    try:
        if error is not None:
            return Sampled(NO_TOKEN, None, SequenceFault.from_wire(error))
        if type(token) is not int or not 0 <= token < (vocab_size or 2**31):
            raise ValueError(f"{token!r:.50} is not a token id of its vocabulary")
        entry = None if logprob is None else TokenLogprob.from_wire(logprob)
        if entry is not None and vocab_size and any(not 0 <= t < vocab_size for t, _ in entry.top):
            raise ValueError("a top logprob names a token outside its vocabulary")
        return Sampled(token, entry)
    except ValueError as exc:
        return Sampled(NO_TOKEN, None, SequenceFault("internal", f"{peer} sent {exc}"))
