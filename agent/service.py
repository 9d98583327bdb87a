"""AgentService: turns decoded wire requests into ModelRunner calls and builds the replies.

No sockets here; agent/process.py moves the frames. Every failure becomes an error reply: a bad
request never stops the agent.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np
from pydantic import ValidationError

from agent.contract import protocol
from agent.contract.sampling import SequenceFault, TokenLogprob
from agent.contract.step import StepChunk
from agent.drafter import Drafter
from agent.kv_transfer import KVSender, TransferError, export_kv, import_kv, largest_kv_transfer_bytes
from agent.runner import MAX_DRAFT_TOKENS, ModelRunner, RunnerError

log = logging.getLogger(__name__)


CANCELLED_TICKETS_KEPT = 4096
# Room for any header (small fields; a KV state lists at most a sequence's tokens) and any token or
# slot array, whatever the model: the floor of an agent's largest legal frame.
HEADER_AND_TOKENS_BYTES = 1 << 20


def largest_frame_bytes(runner: ModelRunner, role: str) -> int:
    """The largest frame a peer may legally send this agent: its ZeroMQ MAXMSGSIZE, so a larger one
    is dropped (with its connection) before it is held in memory. Only a decode agent takes K/V."""
    tokens = 16 * runner.max_len + HEADER_AND_TOKENS_BYTES
    kv = largest_kv_transfer_bytes(runner) if role == "decode" else 0
    return min(protocol.MAX_FRAME_BYTES, max(tokens, kv))


class StaleSession(Exception):
    """A request from a server that no longer holds (or may not take) this agent."""


class AgentService:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        model_name: str,
        rank: int,
        port: int,
        role: str = "mixed",
        sender: KVSender | None = None,
        drafter: Drafter | None = None,
    ):
        self.runner = runner
        self.drafter = drafter  # the draft model's proposals (runtime.speculation method draft)
        self.sender = sender  # a prefill agent's connections to the decode agents
        self.facts = {
            "protocol": protocol.PROTOCOL_VERSION,
            "model": model_name,
            "vocab_size": runner.spec.vocab_size,
            "eos_ids": list(runner.spec.eos_ids),
            "num_slots": runner.num_slots,
            "max_seq_len": runner.max_len,
            "max_prompt_len": runner.max_prompt_len,
            "num_blocks": runner.num_blocks,
            "block_size": runner.runtime.block_size,
            "max_chunk": runner.max_chunk,
            "chunked_prefill": runner.chunked_prefill,
            "prefix_caching": runner.prefix_caching,
            "mixed_rows": runner.mixed_rows if role == "mixed" else 0,
            "prefill_buckets": runner.runtime.prefill_buckets,
            "decode_batch_buckets": runner.runtime.decode_batch_buckets,
            "attend_buckets": runner.runtime.attend_buckets,
            "role": role,
            "rank": rank,
            "port": port,
            "max_frame_bytes": largest_frame_bytes(runner, role),
        }
        self.shutdown_requested = False
        self.session: int | None = None  # set by `reset`; see protocol.py
        self.epoch = 0  # the start time of the server holding the session: an older one cannot reset
        self.cancelled_tickets: deque[int] = deque(maxlen=CANCELLED_TICKETS_KEPT)

    def handle(self, frames: list, from_peer: bool = False) -> list:
        """Request frames -> reply frames. `from_peer`: sent with another agent's CURVE key, which
        may ask only protocol.PEER_OPS."""
        try:
            header, arrays = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            return protocol.error_reply(None, str(exc))
        except Exception as exc:  # a frame decode() did not foresee: a reply, never a dead agent
            log.exception("undecodable request")
            return protocol.error_reply(None, f"undecodable request: {type(exc).__name__}")
        op = header.get("op")
        handler = getattr(self, f"_op_{op}", None) if op in protocol.OPS else None
        if handler is None:
            return protocol.error_reply(header, f"unknown op {op!r} (known: {', '.join(protocol.OPS)})")
        if from_peer and op not in protocol.PEER_OPS:
            log.warning("refused %s from another agent's key", op)
            return protocol.error_reply(
                header, f"{op}: another agent may only send {', '.join(protocol.PEER_OPS)}"
            )
        if op in protocol.SESSION_OPS and "session" not in header:
            # Without this, any local process could release or decode another user's slot.
            return protocol.error_reply(
                header,
                f"{op} needs the current session (a server opens one "
                f"with reset and names it in every slot operation)",
            )
        if op in protocol.SESSION_OPS and header["session"] != self.session:
            return protocol.error_reply(
                header,
                f"{op}: session {header['session']} is not the current one (another server took over)",
                kind="stale_session",
            )
        started = time.perf_counter()
        try:
            fields, out_arrays = handler(header, arrays)
        except StaleSession as exc:
            return protocol.error_reply(header, str(exc), kind="stale_session")
        except TransferError as exc:
            log.warning("KV transfer failed: %s", exc)
            return protocol.error_reply(header, f"{op}: {exc}", kind="transfer_failed")
        except (RunnerError, ValidationError, ValueError, TypeError, KeyError) as exc:
            return protocol.error_reply(header, f"{op}: {exc}")
        except Exception as exc:  # a real failure inside the runner: report it, keep serving
            log.exception("op %s failed", op)
            return protocol.error_reply(header, f"{op} failed: {type(exc).__name__}: {exc}", kind="internal")
        # the op's own time, so the server can tell its share (ZeroMQ, (de)serialising) from the model's
        fields["compute_ms"] = round((time.perf_counter() - started) * 1000, 3)
        return protocol.ok_reply(header, fields, out_arrays)

    # Each op returns (reply fields, reply arrays).

    def _op_info(self, header: dict, arrays: list) -> tuple[dict, list]:
        return dict(self.facts), []

    def _op_ping(self, header: dict, arrays: list) -> tuple[dict, list]:
        return {}, []

    def _op_shutdown(self, header: dict, arrays: list) -> tuple[dict, list]:
        self.shutdown_requested = True
        return {}, []

    def _op_reset(self, header: dict, arrays: list) -> tuple[dict, list]:
        session = _int_field(header, "session")
        epoch = _int_field(header, "epoch") if "epoch" in header else 0
        if epoch < self.epoch:
            # A server started before the one holding the session (its recovery, say) must not
            # take the agent back: the two would alternate, each failing the other's requests.
            raise StaleSession(
                f"reset: a newer server holds this agent (started at epoch {self.epoch}, yours at {epoch})"
            )
        for slot in list(self.runner.slots):
            self.runner.release(slot)
        if session != self.session:
            log.info("session %d opened: every slot released", session)
        self.session, self.epoch = session, epoch
        return {}, []

    def _op_prefill(self, header: dict, arrays: list) -> tuple[dict, list]:
        arrays, masks = _token_masks(header, arrays)
        tokens, table = _int_arrays(arrays, "prefill", ("token ids", "block table"))
        chunk = StepChunk.from_wire(header, tokens, table)  # a prefill is one chunk, alone
        slot, sample = chunk.slot, chunk.sample
        transfer = header.get("transfer")
        if transfer is not None:
            if self.sender is None:
                raise ValueError("this agent sends no KV (its role is not prefill)")
            if not isinstance(transfer, dict):
                raise ValueError("transfer must be a map")
            if not sample:
                raise ValueError("a prefill that sends its KV computes the whole prompt (sample: true)")
        if set(masks) - {slot} or (masks and not sample):
            raise ValueError(f"a prefill's token mask is for its own slot ({slot}), when it samples")
        if chunk.sampling is None:
            self.runner.prefill_chunk(slot, chunk.tokens, table, chunk.start)
            return {"token": None}, []
        token = self.runner.prefill(slot, chunk.tokens, chunk.sampling, table, chunk.start, masks.get(slot))
        reply = {"token": token, **self._per_slot([slot])}
        if transfer is None or self.sender is None:  # with a transfer there is a sender (checked above)
            return reply, []
        if self.runner.fault(slot) is not None:  # nothing to send: the sequence ends here
            self.runner.release(slot)
            return reply, []
        try:  # the slot is free again whatever happens to the transfer
            blocks, state = export_kv(self.runner, slot)
        finally:
            self.runner.release(slot)
        address, decode_table = transfer.get("address"), transfer.get("table")
        if not isinstance(address, str):
            raise ValueError("transfer.address must be the decode agent's address")
        if not isinstance(decode_table, list) or not all(type(b) is int for b in decode_table):
            raise ValueError("transfer.table must be the decode agent's block table (integers)")
        fields = {
            "slot": _int_field(transfer, "slot"),
            "session": _int_field(transfer, "session"),
            "ticket": _int_field(transfer, "ticket"),
            "state": state,
        }
        transfer_ms = self.sender.send(address, fields, [blocks, np.asarray(decode_table, np.int32)])
        log.info(
            "KV of %d tokens (%d bytes) sent to %s slot %d in %.1f ms",
            state["length"],
            blocks.nbytes,
            address,
            fields["slot"],
            transfer_ms,
        )
        return {**reply, "kv_bytes": blocks.nbytes, "transfer_ms": transfer_ms}, []

    def _op_kv_receive(self, header: dict, arrays: list) -> tuple[dict, list]:
        ticket = _int_field(header, "ticket")
        if ticket in self.cancelled_tickets:
            raise ValueError(f"transfer {ticket} was cancelled by the scheduler (it came too late)")
        if len(arrays) != 2 or not isinstance(header.get("state"), dict):
            raise ValueError("kv_receive takes a K/V array, a block table and a state map")
        blocks, table = arrays
        if table.ndim != 1 or table.dtype.kind != "i":
            raise ValueError("kv_receive's second array is the block table: 1-D integers")
        import_kv(self.runner, _int_field(header, "slot"), blocks, header["state"], table)
        return {}, []

    def _op_decode(self, header: dict, arrays: list) -> tuple[dict, list]:
        arrays, masks = _token_masks(header, arrays)
        if len(arrays) != 2 or arrays[1].ndim != 2 or arrays[1].dtype.kind != "i":
            raise ValueError("decode takes slot ids [n] and block tables [n, blocks]")
        (slots,) = _int_arrays(arrays[:1], "decode", ("slot ids",))
        tables = arrays[1]
        if len(tables) != len(slots):
            raise ValueError(f"decode of {len(slots)} slots got {len(tables)} block tables")
        tokens = self.runner.decode(slots.tolist(), list(tables), masks)
        return self._per_slot(slots.tolist()), [np.asarray(tokens, dtype=np.int32)]

    def _op_step(self, header: dict, arrays: list) -> tuple[dict, list]:
        arrays, masks = _token_masks(header, arrays)
        specs = header.get("chunks")
        asked = _drafts(header)
        if not isinstance(specs, list) or len(specs) > self.runner.num_slots or not (specs or asked):
            raise ValueError(f"step takes a list of up to {self.runner.num_slots} chunks, or drafts, or both")
        if len(arrays) != 2 + 2 * len(specs) or arrays[1].ndim != 2 or arrays[1].dtype.kind != "i":
            raise ValueError(
                "step takes decode slot ids [n], their block tables [n, blocks], then tokens and a block "
                "table per chunk"
            )
        (slots,) = _int_arrays(arrays[:1], "step", ("slot ids",))
        if len(arrays[1]) != len(slots):
            raise ValueError(f"step decodes {len(slots)} slots with {len(arrays[1])} block tables")
        chunks = []
        for i, spec in enumerate(specs):
            tokens, table = _int_arrays(arrays[2 + 2 * i : 4 + 2 * i], "step", ("token ids", "block table"))
            chunks.append(StepChunk.from_wire(spec, tokens, table))
        slot_ids, tables = slots.tolist(), list(arrays[1])
        drafts = self._proposals(asked, slot_ids, tables)
        if chunks or drafts:
            decoded, firsts = self.runner.step(slot_ids, tables, chunks, masks, drafts)
        else:  # the draft model proposed nothing (slots it cannot follow): a plain decode
            decoded, firsts = [[t] for t in self.runner.decode(slot_ids, tables, masks)], []
        sampled = [c.slot if t is not None else None for c, t in zip(chunks, firsts)]
        reply = {
            "chunk_tokens": firsts,
            **(self._per_token(slot_ids, decoded) if asked else self._per_slot(slot_ids)),
            **self._per_slot(sampled, "chunk_"),
        }
        flat = [token for tokens in decoded for token in tokens]
        return reply, [np.asarray(flat, dtype=np.int32)]

    def _proposals(
        self, asked: dict[int, list[int] | int], slots: list[int], tables: list[np.ndarray]
    ) -> dict[int, list[int]]:
        """The step's proposals: the server's tokens, and the draft model's for the slots that
        ask it for a number of them (a slot it cannot follow gets none)."""
        counts = {slot: v for slot, v in asked.items() if isinstance(v, int)}
        drafts = {slot: v for slot, v in asked.items() if isinstance(v, list)}
        if not counts:
            return drafts
        if self.drafter is None:
            raise ValueError("this agent has no draft model (runtime.speculation method draft)")
        if not set(counts) <= set(slots) or any(not 1 <= k <= MAX_DRAFT_TOKENS for k in counts.values()):
            raise ValueError(f"draft counts are 1..{MAX_DRAFT_TOKENS} tokens for slots this step decodes")
        for slot in counts:
            self.runner.active(slot)  # a slot that holds nothing is refused before the draft runs
        by_slot = dict(zip(slots, tables))
        return drafts | self.drafter.propose(counts, {s: by_slot[s] for s in counts})

    def _per_token(self, slots: list[int], decoded: list[list[int]]) -> dict:
        """A step with drafts: `counts`, each decode slot's number of tokens, and the fields of
        _per_slot with one entry per token (a slot's tokens in order), whether or not the slot's
        request asked for logprobs: the server pairs the lists with the tokens."""
        fields: dict = {"counts": [len(tokens) for tokens in decoded]}
        logprobs: list[TokenLogprob | None] = []
        errors: list[SequenceFault | None] = []
        for slot, tokens in zip(slots, decoded):
            paired, fault = self._token_logprobs(slot, len(tokens)), self.runner.fault(slot)
            if paired is None:  # a bug of this slot's: its sequence's error, not the whole reply's
                paired = [None] * len(tokens)
                fault = SequenceFault("internal", "its tokens' logprobs were lost (see the agent's log)")
            logprobs += paired
            errors += [fault] * len(tokens)
        for field, entries in (("logprobs", logprobs), ("errors", errors)):
            if any(e is not None for e in entries):
                fields[field] = [None if e is None else e.to_wire() for e in entries]
        return fields

    def _token_logprobs(self, slot: int, count: int) -> list[TokenLogprob | None] | None:
        """The logprobs of the slot's `count` tokens of this step (nulls where its request asked
        none), or None, logged, where they do not pair with its tokens."""
        if count == 1:
            return [self.runner.logprobs(slot)]
        recent = self.runner.recent_logprobs(slot)
        if not recent:  # its request asked for no logprobs
            return [None] * count
        if len(recent) != count:
            log.error(
                "slot %d: %d logprobs for %d verified tokens; its sequence fails", slot, len(recent), count
            )
            return None
        return recent

    def _per_slot(self, slots: list[int | None], prefix: str = "") -> dict:
        """The fields that go with the slots' tokens where any slot has them, else none (which
        keeps most replies as they were): `logprobs`, each slot's last token logprobs or null when
        its request asked for them, and `errors`, each slot's fault or null when a choice failed
        (None: a chunk that did not sample)."""
        fields = {}
        for field, entry_of in (("logprobs", self.runner.logprobs), ("errors", self.runner.fault)):
            entries = [None if s is None else entry_of(s) for s in slots]
            if any(e is not None for e in entries):
                fields[prefix + field] = [None if e is None else e.to_wire() for e in entries]
        return fields

    def _op_release(self, header: dict, arrays: list) -> tuple[dict, list]:
        if "ticket" in header:
            self.cancelled_tickets.append(_int_field(header, "ticket"))
        self.runner.release(_int_field(header, "slot"))
        return {}, []


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


def _drafts(header: dict) -> dict[int, list[int] | int]:
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


def _int_field(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"field {name!r} must be an integer, got {value!r}")
    return value


def _int_arrays(arrays: list, op: str, what: tuple[str, ...]) -> list[np.ndarray]:
    if len(arrays) != len(what) or any(a.ndim != 1 or a.dtype.kind != "i" for a in arrays):
        raise ValueError(f"{op} takes {len(what)} 1-D integer arrays: {', '.join(what)}")
    return arrays
