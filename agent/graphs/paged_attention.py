"""Paged attention with the contract of MindSpore's Ascend inference kernels (`ReshapeAndCache`,
`PagedAttention`, `FlashAttentionScore` as MindSpore's internal kernels run them under the predict
phase, and as vllm-mindspore's Attention layer calls them on 910B), the attention of
`runtime.decode_attention: paged` (the default on Ascend).

A layer's K (and V) cache is [num_blocks, block_size, kv_heads, head_dim]. A step's N rows hold the
new tokens of B sequences, each sequence's rows contiguous (agent/graphs/graph_inputs.py
PagedInputs builds them; padding rows form sequences of their own in the scratch blocks):
- slot_mapping [N] int32: the cache slot each row's new K/V goes to, block * block_size + offset;
- block_tables [B, MB] int32: each sequence's block table (the tables the server hands out, the same
  ones the CPU kernels read, so a prefix-cache hit reads blocks another sequence wrote);
- batch_valid_length [B] int32: each sequence's positions once this step's rows are written (its
  cached context plus its new rows);
- q_seq_lens [B] int32: each sequence's new rows.
The internal PagedAttention kernel reads the last two from the graph's inputs *named*
`batch_valid_length` and `q_seq_lens` (MindSpore's LLMManager, keyed by the parameter's name), not
from its `context_lens` operand, so the step graphs' parameters carry exactly these names
(agent/graphs/step_graphs.py PagedStepGraph) and `python -m tools.ascend_ops` checks them.

Two phases, two kernels. A step whose every sequence starts at position 0 (whole prompts) runs the
`prefill` phase: `FlashAttentionScore` in the TH layout over the rows' own K/V, actual_seq_qlen =
q_seq_lens and actual_seq_kvlen = batch_valid_length (per-sequence lengths, as vllm-mindspore passes
them to the internal kernel), the causal mask compressed to a 128 x 128 upper triangle. Every other
step (decode rows, prompt chunks after cached positions, mixed steps, speculative verification) runs
the `increment` phase: `PagedAttention` over the block tables, with a lookahead mask [N, MB * B]
(0 where a row may look, graph_inputs.MASK_VALUE after its own position) when a sequence has more than one new
row, a [1, 1] zero mask when every sequence has one. Both write the new K/V first through
`ReshapeAndCache`, the read ordered after the write by `ops.depend`.

PagedAttention (the class) is the reference in standard MindSpore ops over the same inputs, run on
every target and tested on CPU against the fused CPU kernels and the numpy forward
(tests/integration/agent/test_ascend_graphs.py): it derives each row's visible positions from
batch_valid_length and q_seq_lens (and adds the mask), so wrong values in either fail the CPU
tests. It gathers each row's whole table, so it is the semantics and the CPU check, not a fast path.
AscendPagedAttention calls the Ascend kernels with the same inputs; this project has no NPU, so it
has never run (README "On Ascend"); its graphs' contract is checked statically
(agent/graphs/graph_contract.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.ops.auto_generate import FlashAttentionScore, ReshapeAndCache
from mindspore.ops.auto_generate import PagedAttention as PagedAttentionOp

from config.schema import RuntimeSection

NO_LIMIT = 2147483647  # FlashAttentionScore's pre_tokens and next_tokens: the mask alone decides


class PagedAttention(nn.Cell):
    """The reference: write and attend in standard MindSpore ops. Queries come scaled (the layers fold
    the attention scale into their Q rows), so the scale here is 1."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, blocks_per_seq: int, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = heads // kv_heads
        self.block_size = block_size
        self.dtype, self.half = dtype, dtype != ms.float32
        # positions of one table, to compare with each row's visible length
        self.table_positions = Tensor(np.arange(blocks_per_seq * block_size, dtype=np.int32)[None, :])
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    def write(self, key, value, key_cache, value_cache, slot_mapping):
        """key, value [N, KV, hd] into slots slot_mapping [N] of the caches (ReshapeAndCache); returns
        what the reads depend on."""
        where = ops.stack([slot_mapping // self.block_size, slot_mapping % self.block_size], 1)  # [N, 2]
        written = ops.depend(slot_mapping, ops.scatter_nd_update(key_cache, where, key))
        return ops.depend(written, ops.scatter_nd_update(value_cache, where, value))

    def attend(self, query, key_cache, value_cache, block_tables, batch_valid_length, q_seq_lens, attn_mask):
        """query [N, H, hd] -> [N, H * hd] (PagedAttention): each row over the positions of its
        sequence's table up to its own, plus attn_mask ([N, MB * B] or [1, 1])."""
        sequence, visible, _ = self._rows(query, batch_valid_length, q_seq_lens)
        tables = ops.gather(block_tables, sequence, 0)  # [N, MB]
        keys = self._positions(key_cache, tables)  # [N, KV, L, hd]
        values = self._positions(value_cache, tables)
        q = ops.reshape(query, (-1, self.kv_heads, self.group, self.head_dim))
        scores = self.bmm_t(q, keys)  # [N, KV, G, L]
        scores = ops.cast(scores, ms.float32) if self.half else scores
        scores = scores + ops.expand_dims(ops.expand_dims(ops.cast(attn_mask, ms.float32), 1), 1)
        hidden = ops.logical_not(self.table_positions < ops.expand_dims(visible, 1))  # [N, L]
        out = self._weighted(scores, ops.expand_dims(ops.expand_dims(hidden, 1), 1), values)
        return ops.reshape(out, (-1, self.heads * self.head_dim))

    def prompt(self, query, key, value, batch_valid_length, q_seq_lens, attn_mask):
        """query [N, H, hd], key and value [N, KV, hd] -> [N, H * hd] (FlashAttentionScore, TH): each
        row over its own sequence's rows up to itself (every sequence starts at position 0; the
        compressed mask `attn_mask` is the kernel's form of that causality)."""
        sequence, visible, rows = self._rows(query, batch_valid_length, q_seq_lens)
        own = ops.expand_dims(sequence, 1) == ops.expand_dims(sequence, 0)
        first = ops.expand_dims(rows - visible + 1, 1)  # the row of its sequence's position 0
        column = ops.expand_dims(rows, 0)
        hidden = ops.logical_not(own & (column >= first) & (column <= ops.expand_dims(rows, 1)))  # [N, N]
        q = ops.reshape(query, (-1, self.kv_heads, self.group, self.head_dim))
        q = ops.reshape(ops.transpose(q, (1, 2, 0, 3)), (self.kv_heads, -1, self.head_dim))  # [KV, G*N, hd]
        scores = self.bmm_t(q, ops.transpose(key, (1, 0, 2)))  # [KV, G*N, N]
        scores = ops.cast(scores, ms.float32) if self.half else scores
        out = self._weighted(scores, ops.tile(hidden, (self.group, 1)), ops.transpose(value, (1, 0, 2)))
        out = ops.reshape(out, (self.kv_heads, self.group, -1, self.head_dim))  # [KV, G, N, hd]
        return ops.reshape(ops.transpose(out, (2, 0, 1, 3)), (-1, self.heads * self.head_dim))

    def _weighted(self, scores, hidden, values):
        """softmax(scores, hidden positions out) @ values, in the model's dtype."""
        probs = ops.softmax(ops.masked_fill(scores, hidden, float("-inf")), -1)
        probs = ops.cast(probs, self.dtype) if self.half else probs
        return self.bmm(probs, values)

    @staticmethod
    def _rows(query, batch_valid_length, q_seq_lens):
        """Each of query's N rows' sequence, the positions it sees (its own included) and its index,
        [N] each, from the per-sequence lengths (rows of a sequence are contiguous): row r of a
        sequence whose rows end at e sees batch_valid_length - (e - r) + 1 positions."""
        ends = ops.cumsum(q_seq_lens, 0)  # [B]
        rows = ops.cumsum(ops.cast(ops.ones_like(query[:, 0, 0]), ms.int32), 0) - 1  # [N]: 0..N-1
        sequence = ops.reduce_sum(
            ops.cast(ops.expand_dims(ends, 0) <= ops.expand_dims(rows, 1), ms.int32), 1
        )  # [N]
        visible = ops.gather(batch_valid_length, sequence, 0) - ops.gather(ends, sequence, 0) + rows + 1
        return sequence, visible, rows

    def _positions(self, cache, block_tables):
        """The cache at every position of each row's table: [N, KV, MB * B, hd]."""
        rows = ops.gather(cache, block_tables, 0)  # [N, MB, B, KV, hd]
        rows = ops.reshape(rows, (-1, self.table_positions.shape[1], self.kv_heads, self.head_dim))
        return ops.transpose(rows, (0, 2, 1, 3))


class AscendPagedAttention(PagedAttention):
    """The same calls on the Ascend kernels, as vllm-mindspore's Attention layer makes them (K/V and
    queries flattened to [N, heads * head_dim]). Never run: this project has no NPU; MindSpore's CPU
    build has no kernel for these ops, so these graphs compile only on Ascend (their contract is
    checked on CPU by agent/graphs/graph_contract.py)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, blocks_per_seq: int, dtype):
        super().__init__(heads, kv_heads, head_dim, block_size, blocks_per_seq, dtype)
        self.reshape_and_cache = ReshapeAndCache()
        self.paged_attention = PagedAttentionOp(heads, 1.0, kv_heads)
        self.flash_attention = FlashAttentionScore(
            heads, scale_value=1.0, pre_tokens=NO_LIMIT, next_tokens=NO_LIMIT, input_layout="TH"
        )

    def write(self, key, value, key_cache, value_cache, slot_mapping):
        kv = self.kv_heads * self.head_dim
        return self.reshape_and_cache(
            ops.reshape(key, (-1, kv)), ops.reshape(value, (-1, kv)), key_cache, value_cache, slot_mapping
        )

    def attend(self, query, key_cache, value_cache, block_tables, batch_valid_length, q_seq_lens, attn_mask):
        query = ops.reshape(query, (-1, self.heads * self.head_dim))
        return self.paged_attention(
            query, key_cache, value_cache, block_tables, batch_valid_length, None, None, attn_mask, q_seq_lens
        )

    def prompt(self, query, key, value, batch_valid_length, q_seq_lens, attn_mask):
        kv = self.kv_heads * self.head_dim
        _, _, _, out = self.flash_attention(
            ops.reshape(query, (-1, self.heads * self.head_dim)),
            ops.reshape(key, (-1, kv)),
            ops.reshape(value, (-1, kv)),
            None,
            None,
            None,
            attn_mask,
            None,
            q_seq_lens,
            batch_valid_length,
        )
        return out


# A layer's backend from its heads, KV heads, head size and dtype (keywords)
PagedBackend = Callable[..., PagedAttention]


def paged_backend(runtime: RuntimeSection) -> PagedBackend | None:
    """The paged attention the layers of `runtime` run: the Ascend kernels on Ascend, the reference
    elsewhere; None where they attend by the CPU kernels or by gather."""
    if not runtime.paged_attention:
        return None
    backend = AscendPagedAttention if runtime.device_target == "Ascend" else PagedAttention
    blocks_per_seq = -(-runtime.planned_max_seq_len // runtime.block_size)
    return functools.partial(backend, block_size=runtime.block_size, blocks_per_seq=blocks_per_seq)
