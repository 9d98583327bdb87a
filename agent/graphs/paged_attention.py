"""Paged attention with the semantics of the upstream Ascend ops (MindSpore's `ReshapeAndCache` and
`PagedAttention`, as vllm-mindspore and MindFormers call them), the attention of
`runtime.decode_attention: paged` (the default on Ascend).

A layer's K (and V) cache is [num_blocks, block_size, kv_heads, head_dim]. A step's T rows (decode
tokens, prompt chunks and mixed steps alike: agent/graphs/interface.py GraphInputs builds the same
inputs for each) give:
- slot_mapping [T]: the cache slot each row's new K/V goes to, block * block_size + offset (the block
  from the row's table, as the CPU kernels' write rows; padding rows write to the scratch blocks);
- block_tables [T, MB]: each row's sequence's block table (the tables the server hands out, the same
  ones the CPU kernels read, so a prefix-cache hit reads blocks another sequence wrote);
- context_lens [T]: the positions 0..len-1 of its table each row attends, its own included (a row of
  a prompt chunk at position p attends p + 1, so a chunk sees the positions cached before it).

PagedAttention is the reference in standard MindSpore ops (ScatterNdUpdate for the write, Gather by
block table and a masked softmax for the attention), which runs on every target and is tested on CPU
against the fused CPU kernels (tests/integration/agent/test_ascend_graphs.py). It gathers each
row's whole table (rows x max_seq_len positions of K and V per layer), so it is the semantics and the
CPU check, not a fast path. AscendPagedAttention calls the Ascend kernels with the same inputs; this
project has no NPU and no CANN, so that layer has never run (README "On Ascend"); its graphs are
checked statically (agent/graphs/op_check.py). Every row, prompts included, goes through
PagedAttention: FlashAttentionScore (a prompt from position 0 attending only itself) is not used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.ops.operations.nn_ops import PagedAttention as PagedAttentionOp
from mindspore.ops.operations.nn_ops import ReshapeAndCache

from config.schema import RuntimeSection


class PagedAttention(nn.Cell):
    """The reference: write and attend in standard MindSpore ops. Queries come scaled (the layers fold
    the attention scale into their Q rows), so the scale here is 1."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, blocks_per_seq: int, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = heads // kv_heads
        self.block_size = block_size
        self.dtype, self.half = dtype, dtype != ms.float32
        # positions of one table, to compare with context_lens
        self.table_positions = Tensor(np.arange(blocks_per_seq * block_size, dtype=np.int32)[None, :])
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    def write(self, key, value, key_cache, value_cache, slot_mapping):
        """key, value [T, KV, hd] into slots slot_mapping [T] of the caches (ReshapeAndCache)."""
        where = ops.stack([slot_mapping // self.block_size, slot_mapping % self.block_size], 1)  # [T, 2]
        ops.scatter_nd_update(key_cache, where, key)
        ops.scatter_nd_update(value_cache, where, value)

    def attend(self, query, key_cache, value_cache, block_tables, context_lens):
        """query [T, H, hd] -> [T, H * hd]: each row over positions 0..context_lens-1 of its block
        table (PagedAttention)."""
        keys = self._positions(key_cache, block_tables)  # [T, KV, L, hd]
        values = self._positions(value_cache, block_tables)
        q = ops.reshape(query, (-1, self.kv_heads, self.group, self.head_dim))
        scores = self.bmm_t(q, keys)  # [T, KV, G, L]
        visible = ops.expand_dims(
            ops.expand_dims(self.table_positions < ops.expand_dims(context_lens, 1), 1), 1
        )
        scores = ops.cast(scores, ms.float32) if self.half else scores
        probs = ops.softmax(ops.masked_fill(scores, ops.logical_not(visible), float("-inf")), -1)
        probs = ops.cast(probs, self.dtype) if self.half else probs
        return ops.reshape(self.bmm(probs, values), (-1, self.heads * self.head_dim))

    def _positions(self, cache, block_tables):
        """The cache at every position of each row's table: [T, KV, MB * B, hd]."""
        rows = ops.gather(cache, block_tables, 0)  # [T, MB, B, KV, hd]
        rows = ops.reshape(rows, (-1, self.table_positions.shape[1], self.kv_heads, self.head_dim))
        return ops.transpose(rows, (0, 2, 1, 3))


class AscendPagedAttention(PagedAttention):
    """The same calls on the Ascend kernels (`ReshapeAndCache`, `PagedAttention`, as vllm-mindspore's
    MsNativeAttnBackend makes them: K/V and queries flattened to [T, heads * head_dim]). Never run: this
    project has no NPU; MindSpore's CPU build has no kernel for either op, so these graphs compile only
    on Ascend (their op list is checked on CPU by agent/graphs/op_check.py)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, blocks_per_seq: int, dtype):
        super().__init__(heads, kv_heads, head_dim, block_size, blocks_per_seq, dtype)
        self.reshape_and_cache = ReshapeAndCache()
        self.paged_attention = PagedAttentionOp(heads, 1.0, kv_heads)

    def write(self, key, value, key_cache, value_cache, slot_mapping):
        kv = self.kv_heads * self.head_dim
        self.reshape_and_cache(
            ops.reshape(key, (-1, kv)), ops.reshape(value, (-1, kv)), key_cache, value_cache, slot_mapping
        )

    def attend(self, query, key_cache, value_cache, block_tables, context_lens):
        query = ops.reshape(query, (-1, self.heads * self.head_dim))
        out = self.paged_attention(query, key_cache, value_cache, block_tables, context_lens)
        return ops.reshape(out, (-1, self.heads * self.head_dim))


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
