"""What ModelRunner and a graph set agree on: the calls (ModelGraphs, KVTransferGraphs) and how host-side
values become the prefill and decode graphs' inputs (GraphInputs, in agent/graphs/graph_inputs.py; the
sizes it works with in agent/graphs/shapes.py; both importable from here).

Graph sets: agent.graphs.step_graphs.StepGraphs (built from code), agent.graphs.mindir.MindIRGraphs (run from
exported files) and agent.graphs.mindir.GraphExporter (exports each graph on its first call). The runner
deals in slots, token ids, positions and bucket sizes; each graph set turns them into its own tensors
through its GraphInputs. This module is the one place outside the graphs' own code that reads the
kernel choice (runtime.attention_kernel, runtime.matmul_kernel, runtime.paged_attention): what it
changes in the inputs, in the decode shapes, in an export's settings and in the weights' memory.
NumPy only.

KV cache rows: one flat cache per layer and kind, paged in blocks of runtime.block_size (B)
positions: [blocks * kv_heads * B, head_dim], position p of KV head h of a sequence with block table
T at row (T[p // B] * kv_heads + h) * B + p % B (a block holds B consecutive positions of each head,
one head after the other). A table lists MB = ceil(max_seq_len / B) blocks. The pool holds
runtime.num_blocks blocks that the server hands out, then the scratch blocks that padded batch rows
and prompt padding write to (scratch_table: as many as the largest prefill bucket needs, its last
one repeated). Where the pool holds every slot's whole length, slot s has a fixed table, blocks
s * MB .. s * MB + MB - 1 (slot_table: tools and tests). The graphs take block tables, not slots:
the host computes write rows (and, for the gather path, read rows) from them and checks every
index, since the kernels check none of what they are given beyond refusing a call. The paged
backend (agent/graphs/paged_attention.py) keeps the same blocks as [blocks, B, kv_heads, head_dim]
and takes, from the same tables and positions, slot T[p // B] * B + p % B and a length per row.

Sliding-window layers (Gemma 3's local layers, which attend the last `window` positions) do not take
blocks of the pool: each slot has a ring of RB = ceil((window - 1 + the largest prefill bucket) / B)
blocks of its own in those layers' caches (local_ring_blocks), and position p of its sequence lives
in ring block (p // B) % RB, so a block is written over once the window has left it behind. Their
table of slot s is s * RB + (j % RB) for j = 0..MB-1, a table like any other (the kernels read a
sequence's positions through it the same way); the ring after the last slot's is the scratch one
(padding, warm-up). A call writes at most the largest bucket's positions of a sequence, and its
rows read at most window - 1 positions before the first of them, so no position a row reads has been
written over. The pool then holds only the global layers' K and V, and a sequence's local layers
hold RB blocks whatever its length. (A prefix-cache hit cannot give a slot's ring the window before
it: sliding-window models run without prefix caching.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from agent.contract.step import StepChunk
from agent.graphs.graph_inputs import GraphInputs, StateMove, StateMoves
from agent.graphs.shapes import (
    SHAPE_FIELDS,
    bucket,
    decode_attends,
    local_ring_blocks,
    mixed_rows,
    pool_blocks,
    scratch_blocks,
    shape_settings,
    uses_kernels,
)
from agent.model.spec import ModelSpec

if TYPE_CHECKING:
    from mindspore import Tensor

__all__ = [  # the shapes and inputs, importable from here as before the split
    "SHAPE_FIELDS",
    "GraphInputs",
    "StateMove",
    "StateMoves",
    "KVTransferGraphs",
    "MixedStepGraphs",
    "ModelGraphs",
    "PoolingGraphs",
    "bucket",
    "decode_attends",
    "local_ring_blocks",
    "mixed_rows",
    "pool_blocks",
    "scratch_blocks",
    "shape_settings",
    "uses_kernels",
]


class ModelGraphs(Protocol):
    """The graphs a ModelRunner runs. Logits are float32 whatever the model's dtype."""

    spec: ModelSpec
    inputs: GraphInputs  # how this set takes its prefill and decode inputs, and its cache rows
    topk_buckets: list[int]  # the k of each top-k graph

    def prefill(
        self,
        table: np.ndarray,
        tokens: np.ndarray,
        length: int,
        start: int = 0,
        slot: int | None = None,
        every_row: bool = False,
        moves: StateMoves | None = None,
    ) -> Tensor:
        """Prompt `tokens` padded to bucket `length`, at positions start.. of the sequence with block
        `table` [MB] -> logits [1, vocab] of its last token. Positions 0..start-1 are read from the
        cache (GraphInputs.prefill: fused layers only). `slot`: its slot (sliding-window rings,
        Gated DeltaNet states). `every_row` (prompt logprobs): logits [length, vocab] of every row
        instead, padding's last. `moves`: its StateMove (Gated DeltaNet layers)."""

    def decode(
        self,
        tables: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: int,
        attend: int = 0,
        slots: Sequence[int] | None = None,
        moves: StateMoves | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Tokens at `positions` of the sequences with block `tables` [n, MB], padded to `rows` ->
        logits [rows, V] and their argmax [rows]. Each row attends to its positions 0..position;
        `attend`: the gather path's bucket; `slots`: their slots (sliding-window rings, Gated
        DeltaNet states); `moves`: their StateMoves by slot."""

    def argmax(self, logits: Tensor) -> Tensor:
        """Logits [B, V] -> token ids [B]."""

    def topk(self, k: int, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Logits [B, V] -> the k best (values, ids), best first; k one of topk_buckets."""

    def cache_bytes(self) -> int:
        """Memory of this set's KV cache."""


@runtime_checkable
class MixedStepGraphs(ModelGraphs, Protocol):
    """Graphs that run decode rows and prompt chunks in one call (the fused layers: each row reads
    its own block table), so a step reads the weights once; MindIR exports do not."""

    def mixed(
        self,
        decode_tables: np.ndarray,
        decode_tokens: np.ndarray,
        decode_positions: np.ndarray,
        chunks: Sequence[StepChunk],
        rows: int,
        logit_rows: int,
        decode_slots: Sequence[int] | None = None,
        moves: StateMoves | None = None,
    ) -> tuple[Tensor, Tensor]:
        """GraphInputs.mixed's step -> logits [logit_rows, V] (each decode row's, then the last row's
        of each chunk that samples, then padding) and their argmax [logit_rows]."""


@runtime_checkable
class PoolingGraphs(ModelGraphs, Protocol):
    """Graphs that also keep their rows' final hidden states (after the final norm, float32): what a
    pooling request's prompt returns (an embedding); MindIR exports compute logits only."""

    hidden: Tensor | None  # [rows, hidden] of the last prefill or mixed call: every row's
    # the pooled vector's dense projections, in order ([out, in] float32, host-side: an encoder's
    # sentence-transformers Dense modules, EmbeddingGemma's); () for none
    projection: tuple[np.ndarray, ...]


@runtime_checkable
class KVTransferGraphs(ModelGraphs, Protocol):
    """Graphs that also move a slot's K/V between agents (PD disaggregation); MindIR exports do not
    hold them, so the config serves those with mixed groups only."""

    def kv_export(self, table: np.ndarray, length: int) -> np.ndarray:
        """Positions 0..length-1 of the sequence with block `table` -> K/V [2 * layers, KV heads,
        length, row width] (the head dim, or a q8_0 row's bytes: agent/graphs/cache_format.py)."""

    def kv_import(self, table: np.ndarray, blocks: np.ndarray) -> None:
        """K/V [2 * layers, KV heads, length, row width] written into positions 0..length-1 of the
        sequence with block `table`."""

    def state_export(self, slot: int) -> list[np.ndarray]:
        """A live slot's Gated DeltaNet states: conv inputs [layers, conv_state] and recurrent
        matrices [layers, recurrent_state] (float32); [] for a model without such layers."""

    def state_import(self, slot: int, states: list[np.ndarray]) -> None:
        """state_export's arrays written into a live slot's states."""
