"""What ModelRunner and a graph set agree on: the calls (ModelGraphs, KVTransferGraphs) and how host-side
values become the prefill and decode graphs' inputs (GraphInputs).

Graph sets: agent.llama_graphs.LlamaGraphs (built from code), agent.mindir.MindIRGraphs (run from
exported files) and agent.mindir.GraphExporter (exports each graph on its first call). The runner
deals in slots, token ids, positions and bucket sizes; each graph set turns them into its own tensors
through its GraphInputs. This module is the one place outside the graphs' own code that reads the
kernel choice (runtime.attention_kernel, runtime.matmul_kernel): what it changes in the inputs, in
the decode shapes, in an export's settings and in the weights' memory. NumPy only.

KV cache rows: one flat cache per layer and kind, row (slot * kv_heads + head) * max_len + position;
slot num_slots is the scratch slot that padded batch rows write to.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from agent.model.spec import ModelSpec
from config.schema import RuntimeSection

if TYPE_CHECKING:
    from mindspore import Tensor

# The runtime settings an exported graph's shapes and host-side inputs depend on.
SHAPE_FIELDS = (
    "num_slots",
    "max_seq_len",
    "prefill_buckets",
    "decode_batch_buckets",
    "attend_buckets",
    "dtype",
)


def bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest of the sorted `buckets` that holds `n`."""
    return buckets[bisect.bisect_left(buckets, n)]


def decode_attends(runtime: RuntimeSection) -> list[int]:
    """The attended lengths of the decode graphs: the attention kernel reads each sequence's own
    length (0: one decode graph per batch bucket), the gather path attends over a bucket."""
    return [0] if runtime.attention_kernel else list(runtime.attend_buckets)


def shape_settings(runtime: RuntimeSection) -> dict:
    """What an export records of the runtime, and what a configuration must match to run it."""
    settings = {name: getattr(runtime, name) for name in SHAPE_FIELDS}
    settings["attention_kernel"] = runtime.attention_kernel
    if runtime.attention_kernel:
        del settings["attend_buckets"]  # the kernel attends each sequence's own length
    return settings


def uses_kernels(runtime: RuntimeSection) -> bool:
    """Whether the graphs call the custom CPU kernels (agent/kernels)."""
    return runtime.attention_kernel or runtime.matmul_kernel


def packed_copy_bytes(spec: ModelSpec, runtime: RuntimeSection) -> int:
    """Weight memory beyond the parameters: the matmul kernel's float32 packed copy of a tied
    lm_head (the embedding lookup still needs [vocab, hidden])."""
    return spec.vocab_size * spec.hidden_size * 4 if runtime.matmul_kernel and spec.tied_embeddings else 0


class GraphInputs:
    """Host-side inputs of one graph set's prefill and decode graphs, as NumPy arrays in graph order.

    Prefill: tokens, positions, write rows, the mask [G*S, S] (or, with fused layers, the kernel's
    row-major write rows and lengths [S*KV]), the last real token's index. Decode: tokens, positions,
    write rows [B*KV], then with the attention kernel each row's first cache row and length [B*KV],
    else the rows it attends [B*KV, attend] and their mask [B*KV, 1, attend]."""

    def __init__(self, runtime: RuntimeSection, kv_heads: int, group: int, fused_layers: bool):
        """kv_heads: this rank's; fused_layers: each layer is one kernel, which takes row-major
        write rows and lengths in place of the prefill mask."""
        self.num_slots, self.max_len = runtime.num_slots, runtime.max_seq_len
        self.kv_heads, self.group, self.fused_layers = kv_heads, group, fused_layers
        self.attention_kernel = runtime.attention_kernel
        self.decode_attends = decode_attends(runtime)
        self._head_rows = np.arange(kv_heads, dtype=np.int64)

    def attend(self, positions: np.ndarray) -> int:
        """The decode graph's attended length for rows writing at `positions` (0: the kernel's)."""
        return 0 if self.attention_kernel else bucket(self.decode_attends, int(positions.max()) + 1)

    def base_rows(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), KV] first cache row of each (slot, kv head)."""
        return (slots[:, None] * self.kv_heads + self._head_rows[None, :]) * self.max_len

    def slot_rows(self, slot: int, length: int) -> np.ndarray:
        """Cache rows of positions 0..length-1 of a slot, head-major (as prefill writes them)."""
        rows = self.base_rows(np.array([slot]))[0][:, None] + np.arange(length)[None, :]
        return rows.reshape(-1).astype(np.int32)

    def prefill(self, slot: int, tokens: np.ndarray, length: int) -> tuple[np.ndarray, ...]:
        """Prompt `tokens` padded to `length`, written into `slot`."""
        n = len(tokens)
        padded = np.zeros(length, np.int32)
        padded[:n] = tokens
        positions = np.arange(length, dtype=np.int32)
        last = np.array([n - 1], np.int32)
        if self.fused_layers:  # row-major write rows, and lengths in place of the mask
            write = self.base_rows(np.array([slot]))[0][None, :] + positions[:, None]  # [S, KV]
            lengths = np.where(positions < n, positions + 1, 0)
            return (
                padded,
                positions,
                write.reshape(-1).astype(np.int32),
                np.repeat(lengths, self.kv_heads).astype(np.int32),
                last,
            )
        causal = np.where(positions[None, :] > positions[:, None], -np.inf, 0.0).astype(np.float32)
        mask = np.tile(causal, (self.group, 1))  # [G*S, S], query rows grouped per head
        return padded, positions, self.slot_rows(slot, length), mask, last

    def decode(
        self, slots: np.ndarray, tokens: np.ndarray, positions: np.ndarray, rows: int, attend: int
    ) -> tuple[np.ndarray, ...]:
        """Tokens at `positions` of `slots`, padded to `rows` (padding writes to the scratch slot and
        attends nothing); `attend`: the gather path's bucket, ignored by the kernel."""
        pad = rows - len(slots)
        lengths = np.concatenate([positions + 1, np.zeros(pad, np.int64)])  # padding attends nothing
        slots = np.concatenate([slots, np.full(pad, self.num_slots)])  # scratch slot
        tokens = np.concatenate([tokens, np.zeros(pad, np.int64)]).astype(np.int32)
        positions = np.concatenate([positions, np.zeros(pad, np.int64)])
        base = self.base_rows(slots)  # [rows, KV]
        write = (base + positions[:, None]).reshape(-1).astype(np.int32)
        if self.attention_kernel:  # the fused layer computes nothing for padding rows
            return (
                tokens,
                positions.astype(np.int32),
                write,
                base.reshape(-1).astype(np.int32),
                np.repeat(lengths, self.kv_heads).astype(np.int32),
            )
        read = base.reshape(-1, 1) + np.arange(attend)[None, :]  # [rows*KV, attend]
        visible = np.arange(attend)[None, :] <= positions[:, None]  # [rows, attend]
        mask = np.where(visible, 0.0, -np.inf).astype(np.float32).repeat(self.kv_heads, axis=0)
        return tokens, positions.astype(np.int32), write, read.astype(np.int32), mask[:, None, :]


class ModelGraphs(Protocol):
    """The graphs a ModelRunner runs. Logits are float32 whatever the model's dtype."""

    spec: ModelSpec
    inputs: GraphInputs  # how this set takes its prefill and decode inputs, and its cache rows
    topk_buckets: list[int]  # the k of each top-k graph

    def prefill(self, slot: int, tokens: np.ndarray, length: int) -> Tensor:
        """Prompt `tokens` padded to bucket `length` into `slot` -> logits [1, vocab] of its last token."""

    def decode(
        self, slots: np.ndarray, tokens: np.ndarray, positions: np.ndarray, rows: int, attend: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Tokens at `positions` of `slots`, padded to `rows` -> logits [rows, V] and their argmax
        [rows]. Each row attends to its positions 0..position; `attend`: the gather path's bucket."""

    def argmax(self, logits: Tensor) -> Tensor:
        """Logits [B, V] -> token ids [B]."""

    def topk(self, k: int, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Logits [B, V] -> the k best (values, ids), best first; k one of topk_buckets."""

    def cache_bytes(self) -> int:
        """Memory of this set's KV cache."""


@runtime_checkable
class KVTransferGraphs(ModelGraphs, Protocol):
    """Graphs that also move a slot's K/V between agents (PD disaggregation); MindIR exports do not
    hold them, so the config serves those with mixed groups only."""

    def kv_export(self, slot: int, length: int) -> np.ndarray:
        """Positions 0..length-1 of `slot` -> K/V [2 * layers, KV heads, length, head_dim]."""

    def kv_import(self, slot: int, blocks: np.ndarray) -> None:
        """K/V [2 * layers, KV heads, length, head_dim] written into positions 0..length-1 of `slot`."""
