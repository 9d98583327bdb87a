"""The shapes and sizes a runtime configuration gives the graphs: buckets, the attended lengths of
the decode graphs, the KV pool's and scratch blocks, sliding-window rings, the mixed step's rows
(the cache layout they size: agent/graphs/interface.py), the Gated DeltaNet layers' state slots.
NumPy only."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from agent.model.spec import ModelSpec
from config.schema import RuntimeSection

# The runtime settings an exported graph's shapes and host-side inputs depend on.
SHAPE_FIELDS = (
    "num_slots",
    "max_seq_len",
    "num_blocks",
    "block_size",
    "prefill_buckets",
    "decode_batch_buckets",
    "attend_buckets",
    "dtype",
)


def bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest of the sorted `buckets` that holds `n`."""
    return buckets[bisect.bisect_left(buckets, n)]


def decode_attends(runtime: RuntimeSection) -> list[int]:
    """The attended lengths of the decode graphs: the attention kernel and the paged backend read
    each sequence's own length (0: one decode graph per batch bucket), the gather path attends over
    a bucket."""
    return [0] if runtime.attention_kernel or runtime.paged_attention else list(runtime.attend_buckets)


def shape_settings(runtime: RuntimeSection) -> dict:
    """What an export records of the runtime, and what a configuration must match to run it."""
    settings = {name: getattr(runtime, name) for name in SHAPE_FIELDS}
    settings["num_blocks"] = runtime.planned_num_blocks
    settings["attention_kernel"] = runtime.attention_kernel
    if runtime.paged_attention:
        settings["paged_attention"] = True  # absent from exports made before it: they do not match
    if decode_attends(runtime) == [0]:
        del settings["attend_buckets"]  # the kernel attends each sequence's own length
    return settings


def scratch_blocks(runtime: RuntimeSection) -> int:
    """Blocks that padding writes to: the positions of the largest prefill bucket."""
    return -(-runtime.prefill_buckets[-1] // runtime.block_size)


def local_ring_blocks(runtime: RuntimeSection, spec: ModelSpec, max_len: int | None = None) -> int:
    """Blocks of each slot's ring in the sliding-window layers' caches (module docstring); 0 where the
    model has no such layers, or where a ring would be no shorter than a whole sequence of max_len
    (default: the runtime's planned one; those layers then take the pool's blocks like the others)."""
    if not (spec.sliding_window and spec.local_layers):
        return 0
    size = runtime.block_size
    ring = -(-(spec.sliding_window - 1 + runtime.prefill_buckets[-1]) // size)
    longest = runtime.planned_max_seq_len if max_len is None else max_len
    return ring if ring < -(-longest // size) else 0


def pool_blocks(runtime: RuntimeSection) -> int:
    """Blocks of the KV cache: the pool the server hands out, then the scratch blocks."""
    return runtime.planned_num_blocks + scratch_blocks(runtime)


def mixed_rows(runtime: RuntimeSection) -> int:
    """Rows of a mixed step's graph (decode rows and prompt chunks in one call): the smallest prefill
    bucket that holds the largest decode batch and a prompt position more, 0 where none does."""
    needed = runtime.decode_batch_buckets[-1] + 1
    return bucket(runtime.prefill_buckets, needed) if needed <= runtime.prefill_buckets[-1] else 0


def uses_kernels(runtime: RuntimeSection) -> bool:
    """Whether the graphs call the custom CPU kernels (agent/kernels)."""
    return runtime.attention_kernel or runtime.matmul_kernel


@dataclass(frozen=True)
class StateSlots:
    """The Gated DeltaNet layers' state slots (agent/kernels/gated_delta.h): the `live` ones (each
    agent slot's, then a scratch one's), then `snapshots` of prompts' states; and the rows a held run
    keeps for its replay (a verified step's pending token and proposals)."""

    live: int = 0
    snapshots: int = 0
    held_rows: int = 0

    @classmethod
    def of(cls, runtime: RuntimeSection) -> StateSlots:
        return cls(runtime.planned_num_slots + 1, runtime.state_snapshots, held_rows(runtime))

    @property
    def total(self) -> int:
        return self.live + self.snapshots


NO_STATES = StateSlots()


def held_rows(runtime: RuntimeSection) -> int:
    """The rows of a verified step a slot's held run keeps: its pending token and the most
    proposals (0 without speculation)."""
    speculation = runtime.speculation
    return 0 if speculation.method == "none" else speculation.num_tokens + 1
