"""AgentService: turns decoded wire requests into ModelRunner calls and their replies into frames.

No sockets here; agent/process.py moves the frames. Every failure becomes an error reply: a bad
request never stops the agent.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np
from pydantic import ValidationError

from agent.contract import protocol
from agent.contract.step import MAX_DRAFT_TOKENS, KVTransfer, Proposal, StepRequest
from agent.contract.step_reply import StepReply, TierReport
from agent.drafter import Drafter
from agent.kv_tier_moves import export_blocks, import_blocks
from agent.kv_tiers import KVTierStore
from agent.kv_transfer import (
    KVSender,
    TransferError,
    export_kv,
    import_kv,
    largest_kv_transfer_bytes,
    state_shapes,
)
from agent.runner import ModelRunner, RunnerError

log = logging.getLogger(__name__)


CANCELLED_TICKETS_KEPT = 4096
# Room for any header (small fields; a KV state lists at most a sequence's tokens) and any token or
# slot array, whatever the model: the floor of an agent's largest legal frame.
HEADER_AND_TOKENS_BYTES = 1 << 20
# The second tier's blocks named in the info reply (64 hex digits each: 2 MiB at most); the rest are
# only not looked up
REPORTED_TIER_KEYS = 1 << 15


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
        tiers: KVTierStore | None = None,
    ):
        self.runner = runner
        self.tiers = tiers  # the prefix cache's second tier (agent/kv_tiers.py), None: off
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
            "max_proposals": runner.max_proposals if role == "mixed" else 0,
            "state_snapshots": runner.runtime.state_snapshots if runner.spec.linear_attention else 0,
            "mixed_rows": runner.mixed_rows if role == "mixed" else 0,
            "prefill_buckets": runner.runtime.prefill_buckets,
            "decode_batch_buckets": runner.runtime.decode_batch_buckets,
            "attend_buckets": runner.runtime.attend_buckets,
            "role": role,
            "rank": rank,
            "port": port,
            "max_frame_bytes": largest_frame_bytes(runner, role),
        }
        if tiers is not None:  # what a previous run left on disk: the scheduler's index starts from it
            self.facts["kv_tier_keys"] = tiers.recent_keys(REPORTED_TIER_KEYS)
            # a disk tier outlives this process: every computed block goes there, not only evicted ones
            self.facts["kv_tier_write_through"] = tiers.disk_bytes > 0
            # the scheduler's index of the tier's blocks never holds more (lost reports included)
            self.facts["kv_tier_capacity"] = tiers.capacity_blocks
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
        facts = dict(self.facts)
        if self.tiers is not None:  # as of now: a server started later than this agent sees its spills
            facts["kv_tier_keys"] = self.tiers.recent_keys(REPORTED_TIER_KEYS)
        return facts, []

    def _op_drop_cache(self, header: dict, arrays: list) -> tuple[dict, list]:
        if self.tiers is None:
            return {"tier_blocks": 0}, []
        dropped = self.tiers.drop()
        log.info("KV tier: %d blocks dropped (an operator's reset)", dropped)
        return {"tier_blocks": dropped, "tier": self.tiers.report(0.0).to_wire()}, []

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

    def _op_kv_receive(self, header: dict, arrays: list) -> tuple[dict, list]:
        ticket = _int_field(header, "ticket")
        if ticket in self.cancelled_tickets:
            raise ValueError(f"transfer {ticket} was cancelled by the scheduler (it came too late)")
        states = len(state_shapes(self.runner))
        if len(arrays) != 2 + states or not isinstance(header.get("state"), dict):
            raise ValueError(
                f"kv_receive takes a K/V array, a block table, {states} Gated DeltaNet state arrays "
                "and a state map"
            )
        blocks, table, *held = arrays
        if table.ndim != 1 or table.dtype.kind != "i":
            raise ValueError("kv_receive's second array is the block table: 1-D integers")
        import_kv(self.runner, _int_field(header, "slot"), blocks, header["state"], table, held)
        return {}, []

    def _op_step(self, header: dict, arrays: list) -> tuple[dict, list]:
        request = StepRequest.from_wire(header, arrays, self.runner.num_slots)
        if request.transfer is not None and self.sender is None:
            raise ValueError("this agent sends no KV (its role is not prefill)")
        restore_failed, tier = self._move_tiers(request)
        request = replace(request, drafts=self._proposals(request))
        reply = replace(self.runner.execute(request), restore_failed=restore_failed, tier=tier)
        if request.transfer is not None:
            reply = self._send_kv(request.chunks[0].slot, request.transfer, reply)
        return reply.to_wire()

    def _move_tiers(self, request: StepRequest) -> tuple[list[str], TierReport | None]:
        """The step's spills into the tier, then its restores out of it, before anything computes
        (a spilled block may be the one a restore or a chunk writes next); returns the restores'
        digests the tier no longer had (their blocks are left as they are) and the tier's report
        (None: the step moved nothing)."""
        if not (request.spill or request.restore):
            return [], None
        if self.tiers is None:
            raise ValueError("this agent keeps no KV tier (runtime.kv_tiers)")
        if request.spill:
            kvs = export_blocks(self.runner, [block for block, _ in request.spill])
            for (_, digest), kv in zip(request.spill, kvs):
                self.tiers.put(digest, kv)
        started = time.perf_counter()
        blocks: list[int] = []
        held: list[np.ndarray] = []
        failed: list[str] = []
        for (digest, block), found in zip(
            request.restore, self.tiers.get_many([digest for digest, _ in request.restore])
        ):
            if found is None:
                failed.append(digest)
            else:
                blocks.append(block)
                held.append(found)
        import_blocks(self.runner, blocks, held)
        report = self.tiers.report(time.perf_counter() - started if request.restore else 0.0)
        if request.restore:  # a tier hit: the line an operator (and the end-to-end test) looks for
            log.info(
                "KV tier: %d blocks restored in %.1f ms, %d missing, %d spilled (counts %s)",
                len(blocks),
                report.restore_s * 1000,
                len(failed),
                len(request.spill),
                self.tiers.counts,
            )
        return failed, report

    def _send_kv(self, slot: int, transfer: KVTransfer, reply: StepReply) -> StepReply:
        """A prefill agent's prompt: its KV sent to the decode agent's slot, this slot free again
        whatever happens to the transfer (nothing is sent for a sequence that ended here)."""
        assert self.sender is not None  # checked before the step ran
        first = reply.firsts[0]
        if first is None or first.fault is not None:
            self.runner.release(slot)
            return reply
        try:
            blocks, states, state = export_kv(self.runner, slot)
        finally:
            self.runner.release(slot)
        table = np.asarray(transfer.table, np.int32)
        arrays = [blocks, table, *states]
        transfer_ms = self.sender.send(transfer.address, transfer.receive_fields(state), arrays)
        sent = blocks.nbytes + sum(s.nbytes for s in states)
        log.info(
            "KV of %d tokens (%d bytes) sent to %s slot %d in %.1f ms",
            state["length"],
            sent,
            transfer.address,
            transfer.slot,
            transfer_ms,
        )
        return replace(reply, kv_bytes=sent, transfer_ms=transfer_ms)

    def _proposals(self, request: StepRequest) -> dict[int, Proposal]:
        """The step's proposals as token lists: the server's tokens, and the draft model's for the
        slots that ask it for a number of them (a slot it cannot follow gets none)."""
        asked = request.drafts
        counts = {slot: v for slot, v in asked.items() if isinstance(v, int)}
        drafts: dict[int, Proposal] = {slot: v for slot, v in asked.items() if isinstance(v, list)}
        if not counts:
            return drafts
        if self.drafter is None:
            raise ValueError("this agent has no draft model (runtime.speculation method draft)")
        slots = list(request.slots)
        if not set(counts) <= set(slots) or any(not 1 <= k <= MAX_DRAFT_TOKENS for k in counts.values()):
            raise ValueError(f"draft counts are 1..{MAX_DRAFT_TOKENS} tokens for slots this step decodes")
        for slot in counts:
            self.runner.active(slot)  # a slot that holds nothing is refused before the draft runs
        by_slot = dict(zip(slots, request.tables))
        return {**drafts, **self.drafter.propose(counts, {s: by_slot[s] for s in counts})}

    def _op_release(self, header: dict, arrays: list) -> tuple[dict, list]:
        if "ticket" in header:
            self.cancelled_tickets.append(_int_field(header, "ticket"))
        self.runner.release(_int_field(header, "slot"))
        return {}, []


def _int_field(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"field {name!r} must be an integer, got {value!r}")
    return value
