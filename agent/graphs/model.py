"""The whole decoder every family runs: the embedding (scaled where the spec says), the layers
(agent/graphs/decoder.py) one op a layer or all in one op, the final norm and LM head, and the RoPE
tables, as Parameters shared by the prefill and decode graphs (agent/graphs/step_graphs.py)."""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from agent.graphs.cache_format import CacheFormat
from agent.graphs.decoder import DecoderLayer
from agent.graphs.layers import (
    MATMUL_TILE,
    WHOLE_MODEL,
    CpuKernels,
    TensorSplit,
    kept_param,
    param,
    rms_norm,
    rope_tables,
)
from agent.graphs.paged_attention import PagedBackend
from agent.graphs.shapes import NO_STATES, StateSlots
from agent.model.checkpoint import Checkpoint
from agent.model.spec import ModelSpec


class DecoderModel(nn.Cell):
    """Weights, RoPE tables and KV cache, shared by the prefill and decode graphs."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        num_blocks: int,
        block_size: int,
        max_len: int,
        kernels: CpuKernels,
        dtype=ms.float32,
        split: TensorSplit = WHOLE_MODEL,
        local_blocks: int = 0,
        paged: PagedBackend | None = None,
        cache: CacheFormat | None = None,
        device_target: str = "CPU",
        states: StateSlots = NO_STATES,
    ):
        """num_blocks of block_size positions in the KV cache (agent/graphs/interface.py); max_len:
        the positions of the RoPE tables; local_blocks: the blocks of the sliding-window layers' own
        caches (every slot's ring, interface.local_ring_blocks), 0: they take the pool's; paged: the
        layers' paged attention backend (DecoderLayer); cache: the KV cache's rows (None: in dtype);
        device_target: where MindSpore's ops run the layers (their int8 products', experts' kernels);
        states: the state slots each Gated DeltaNet layer holds."""
        super().__init__()
        spec = checkpoint.spec
        self.spec = spec
        start, end = split.share(spec.num_kv_heads)
        self.kv_heads = end - start  # this rank's
        self.kernel_norm = kernels.norm
        self.eps_tensor = Tensor(np.array([spec.rms_eps], np.float32))
        self.cache_format = cache or CacheFormat(str(dtype).lower())
        self.layers = nn.CellList(
            self._layers(
                checkpoint,
                num_blocks,
                block_size,
                kernels,
                dtype,
                split,
                local_blocks,
                paged,
                device_target,
                states,
            )
        )
        self.cache_layers = [layer for layer in self.layers if not layer.delta]  # the layers with a KV cache
        self.state_layers = [layer for layer in self.layers if layer.delta]  # with a state per slot
        self.dtype, self.half = dtype, dtype != ms.float32
        self.paged = paged is not None  # caches [blocks, block_size, KV heads, head_dim]
        # Every layer fused: the whole stack is one op a step (FusedStack, which takes each layer's
        # inputs in a row) instead of one op a layer.
        fused = all(layer.kernel_layer is not None and layer.moe is None for layer in self.layers)
        self.stack: Any = kernels.stack if fused else None
        if self.stack is None and spec.nope_layers:  # only the stack gives a layer tables of its own
            raise ValueError(f"{spec.architecture}: NoPE layers run in the fused CPU kernel's stack only")
        self.stack_inputs = tuple(
            getattr(layer, name)
            for layer in (self.layers if self.stack is not None else ())
            for name in layer.fused_inputs
        )
        # The graphs' `extra` inputs (GraphInputs.extra): the sliding-window layers' write rows and
        # tables where they have caches of their own, then the state slots and moves where the model
        # has Gated DeltaNet layers; the fused kernel's state input where none reads it (input 13).
        self.ring_inputs = local_blocks > 0
        self.recurrent = spec.linear_attention is not None
        self.no_state_slots = Tensor(np.zeros(1, np.int32))
        self._load_embeddings(checkpoint, kernels, dtype)
        self.final_norm = param(checkpoint.tensors["final_norm"], "final_norm")
        self._rope(spec, max_len, dtype)
        self.embed_scale = spec.embed_scale  # a constant: 1 (no op) but for Gemma
        self.eps = spec.rms_eps
        self.matmul_t = ops.MatMul(transpose_b=True)

    def _layers(
        self,
        checkpoint: Checkpoint,
        num_blocks: int,
        block_size: int,
        kernels,
        dtype,
        split,
        local_blocks: int,
        paged: PagedBackend | None,
        device_target: str,
        states: StateSlots,
    ) -> list[DecoderLayer]:
        """The layers, a sliding-window layer with a cache of local_blocks where it has its own."""
        spec = checkpoint.spec
        cache_rows = num_blocks * self.kv_heads * block_size
        local_rows = local_blocks * self.kv_heads * block_size
        return [
            DecoderLayer(
                checkpoint,
                i,
                local_rows if local_rows and spec.is_local(i) else cache_rows,
                block_size,
                kernels,
                dtype,
                split,
                paged,
                self.cache_format,
                device_target,
                states,
            )
            for i in range(spec.num_layers)
        ]

    def _load_embeddings(self, checkpoint: Checkpoint, kernels: CpuKernels, dtype) -> None:
        """The embedding and the LM head. With the matmul kernel they stay in their format (a
        GGUF's, float32 tiles otherwise): the embedding's rows are read by MatrixRows, the LM head
        multiplied by SkinnyMatMulFormat (its I8 twin under int8 activations), and a tied embedding
        is one matrix for both."""
        tied = checkpoint.spec.tied_embeddings
        self.kernel_matmul_format: Any = kernels.matmul_format
        self.kernel_rows: Any = kernels.rows
        self.kept = kernels.matmul_format is not None and not self.half
        if self.kept:
            self.embed, self.embed_format = kept_param(checkpoint, "embed", "embed")
            self.lm_head, self.lm_head_format = (
                (self.embed, self.embed_format) if tied else kept_param(checkpoint, "lm_head", "lm_head")
            )
        else:
            self.embed = param(checkpoint.matrix("embed"), "embed", dtype)
            self.lm_head = self.embed if tied else param(checkpoint.matrix("lm_head"), "lm_head", dtype)

    def _rope(self, spec: ModelSpec, max_len: int, dtype) -> None:
        """The RoPE tables, and the second tables some layers take in their place (the fused stack's
        `local` inputs): the sliding-window layers' where they have a base of their own (Gemma 3's
        10,000 beside 1,000,000), or the NoPE layers' rotation by nothing (SmolLM3's)."""
        cos, sin, rot = rope_tables(spec, max_len)
        self.cos, self.sin = param(cos, "rope_cos", dtype), param(sin, "rope_sin", dtype)
        self.rot = param(rot, "rope_rot", dtype)
        kinds = {spec.rope(i) for i in range(spec.num_layers)} - {"global"}
        if len(kinds) > 1:
            raise ValueError(f"{spec.architecture}: layers with both their own RoPE base and none")
        self.local_rope = bool(kinds)
        if self.local_rope:
            cos, sin, _ = rope_tables(spec, max_len, kinds.pop())
            self.cos_local, self.sin_local = param(cos, "rope_cos_local"), param(sin, "rope_sin_local")

    def state_moves(self, extra):
        """The fused kernel's state input from the graph's `extra`: each table's state slot and
        moves [T, 5] where the model has Gated DeltaNet layers, else a [1] no layer reads."""
        return extra[-1] if self.recurrent else self.no_state_slots

    def run_stack(self, x, cos, sin, write_idx, lengths, tables, row_table, positions, extra):
        """Every layer in one op (self.stack); arguments as DecoderLayer.fused's, then the rows'
        positions (the local layers' RoPE) and `extra` (GraphInputs.extra)."""
        local = extra[:2] if self.ring_inputs else ()
        if self.local_rope:
            cos_local = ops.expand_dims(ops.gather(self.cos_local, positions, 0), 1)
            sin_local = ops.expand_dims(ops.gather(self.sin_local, positions, 0), 1)
        else:
            cos_local, sin_local = cos, sin
        write_local, tables_local = (local[0], local[1]) if local else (write_idx, tables)
        paging = (tables, row_table, self.layers[0].block_size)
        return self.stack(
            x,
            cos,
            sin,
            write_idx,
            lengths,
            self.layers[0].eps_tensor,
            *paging,
            cos_local,
            sin_local,
            write_local,
            tables_local,
            self.state_moves(extra),
            *self.stack_inputs,
        )

    def embed_tokens(self, tokens, positions):
        if self.kept:
            x = self.kernel_rows(tokens, self.embed, self.embed_format)
        else:
            x = ops.gather(self.embed, tokens, 0)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        cos = ops.expand_dims(ops.gather(self.cos, positions, 0), 1)  # [N, 1, hd]
        sin = ops.expand_dims(ops.gather(self.sin, positions, 0), 1)
        return x, cos, sin

    def logits(self, x):
        """Float32 logits whatever the model's dtype: the post-process graphs and the host expect them."""
        return self.lm_head_logits(self.final_normed(x))

    def head(self, x, rows):
        """The float32 logits of `rows` of x (an encoder's: zeros), and every row's final hidden state
        (after the final norm, float32: what a pooling request's prompt pools, SamplingParams.pool;
        row-wise, so the logit rows' are as computed alone)."""
        normed = self.final_normed(x)
        picked = ops.gather(normed, rows, 0)
        if self.spec.bidirectional:
            # An encoder's outputs are its hidden states: it never samples (server/pooling.py refuses
            # generation and rank pooling on one), and its LM head over the vocabulary (Gemma's
            # 262,144 rows: 6 ms of a 36 ms query) is skipped, as llama.cpp's embedding mode does.
            logits = ops.tile(ops.zeros_like(ops.cast(picked[:, :1], ms.float32)), (1, self.spec.vocab_size))
        else:
            logits = self.lm_head_logits(picked)
        return logits, ops.cast(normed, ms.float32) if self.half else normed

    def final_normed(self, x):
        return rms_norm(
            x, self.final_norm, self.eps, self.dtype, self.half, self.kernel_norm, self.eps_tensor
        )

    def lm_head_logits(self, x):
        if self.half:
            return ops.cast(self.matmul_t(x, self.lm_head), ms.float32)
        if not self.kept:
            return self.matmul_t(x, self.lm_head)
        logits = self.kernel_matmul_format(x, self.lm_head, self.lm_head_format)
        vocab = self.spec.vocab_size
        return logits if vocab % MATMUL_TILE == 0 else logits[:, :vocab]

    def cache_bytes(self) -> int:
        rows = sum(layer.k_cache.size // layer.k_cache.shape[-1] for layer in self.cache_layers)
        return 2 * rows * self.cache_format.row_bytes(self.spec.head_dim)
