"""The graphs of each step kind over one decoder (agent/graphs/model.py: its weights and KV cache
as Parameters shared by all): prefill (a prompt chunk), decode (one token of each sequence), the
mixed step (decode rows and prompt chunks in one call), argmax and top-k post-processing, and the KV
export and import of a disaggregated prefill. StepGraphs is the set the runner calls
(agent.graphs.interface.KVTransferGraphs)."""

from __future__ import annotations

from collections.abc import Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from agent.activations import FLOAT_FORMATS
from agent.contract.step import StepChunk
from agent.graphs.cache_format import CacheFormat
from agent.graphs.decoder import DecoderLayer
from agent.graphs.interface import GraphInputs, StateMoves, local_ring_blocks, pool_blocks
from agent.graphs.layers import WHOLE_MODEL, CpuKernels, TensorSplit, release_freed_memory
from agent.graphs.model import DecoderModel
from agent.graphs.paged_attention import paged_backend
from agent.graphs.shapes import NO_STATES, StateSlots
from agent.kernels import TARGET_ENV, has_int8_products
from agent.kernels import target as kernel_target
from agent.model.checkpoint import Checkpoint
from agent.model.families.base import PROJECTIONS
from config.schema import RuntimeSection


class PrefillLayer(nn.Cell):
    """Calls one layer's prefill body. lazy_inline compiles the body once for all layers (a ~3x
    shorter compile on CPU with the same step time, measured), instead of unrolling 30 copies. It
    shares one body among the cells of equal init arguments (their text): `delta` tells a Gated
    DeltaNet layer's body from an attention layer's where their sub-cells alike (a MoE model's
    experts) would not."""

    @ms.lazy_inline(policy="front")
    def __init__(self, layer: DecoderLayer, delta: bool):
        super().__init__()
        self.layer = layer

    def construct(self, x, cos, sin, rot, write_idx, mask, tables, row_table, states):
        layer = self.layer
        return layer.prefill(
            x, cos, sin, rot, write_idx, mask, tables, row_table, layer.k_cache, layer.v_cache, states
        )


class DecodeLayer(nn.Cell):
    """Calls one layer's decode body; lazy_inline as in PrefillLayer."""

    @ms.lazy_inline(policy="front")
    def __init__(self, layer: DecoderLayer, delta: bool):
        super().__init__()
        self.layer = layer

    def construct(self, x, cos, sin, rot, write_idx, where, extent, row_table, states):
        layer = self.layer
        return layer.decode(
            x, cos, sin, rot, write_idx, where, extent, row_table, layer.k_cache, layer.v_cache, states
        )


class TopGraph(nn.Cell):
    """A graph called once a step. MindSpore's Cell call sets `compile_phase` on the cell and
    through its whole tree of sub-cells every call (~94 here, each through Cell.__setattr__'s
    checks: a batch-1 decode step 7.27 -> 6.60 ms without it). Here the tree is walked only when
    this graph's phase changes: it is read while compiling, and a new input shape, which compiles,
    is a new phase."""

    @property
    def compile_phase(self):
        return self._compile_phase

    @compile_phase.setter
    def compile_phase(self, value):
        if value != self._compile_phase:
            nn.Cell.compile_phase.fset(self, value)


class PrefillGraph(TopGraph):
    """One prompt (or chunk) padded to a bucket -> its K/V written through its block table, the last
    real token's logits, and every row's final hidden state (DecoderModel.head)."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model
        self.layers = nn.CellList([PrefillLayer(layer, layer.delta) for layer in model.layers])

    def construct(self, tokens, positions, write_idx, mask, last_index, tables, row_table, *extra):
        x, cos, sin = self.model.embed_tokens(tokens, positions)
        if self.model.stack is not None:
            x = self.model.run_stack(x, cos, sin, write_idx, mask, tables, row_table, positions, extra)
        else:
            states = self.model.state_moves(extra)
            for layer in self.layers:
                x = layer(x, cos, sin, self.model.rot, write_idx, mask, tables, row_table, states)
        return self.model.head(x, last_index)


class MixedStepGraph(TopGraph):
    """Decode rows and prompt chunks in one prefill graph call -> the logit rows' logits and argmax
    (as decode's: the argmax graph, its shape dynamic, cost ~1.6 ms a step at 16 rows), and every
    row's final hidden state."""

    def __init__(self, prefill: PrefillGraph):
        super().__init__()
        self.prefill = prefill

    def construct(self, tokens, positions, write_idx, lengths, logit_rows, tables, row_table, *extra):
        logits, hidden = self.prefill(
            tokens, positions, write_idx, lengths, logit_rows, tables, row_table, *extra
        )
        logits, greedy = logits_and_argmax(logits)
        return logits, greedy, hidden


def logits_and_argmax(logits):
    """A decode graph's outputs: the logits, and their argmax for all-greedy batches (in the graph:
    a separate argmax graph cost ~1.5 ms a step at B = 1, its launch and MindSpore's threads)."""
    return logits, ops.argmax(logits, -1).astype(ms.int32)


class DecodeGraph(TopGraph):
    """One new token for each of B sequences -> K/V written, logits [B, vocab] and their argmax [B]."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model
        self.layers = nn.CellList([DecodeLayer(layer, layer.delta) for layer in model.layers])

    def construct(self, tokens, positions, write_idx, where, extent, row_table, *extra):
        x, cos, sin = self.model.embed_tokens(tokens, positions)
        if self.model.stack is not None:
            x = self.model.run_stack(x, cos, sin, write_idx, extent, where, row_table, positions, extra)
        else:
            states = self.model.state_moves(extra)
            for layer in self.layers:
                x = layer(x, cos, sin, self.model.rot, write_idx, where, extent, row_table, states)
        return logits_and_argmax(self.model.logits(x))


class PagedStepGraph(TopGraph):
    """A step of the paged backend (agent/graphs/paged_attention.py): rows of one or more sequences ->
    K/V written, the logits of `logit_rows` and their argmax. Its inputs carry the names the Ascend
    kernels read them by (batch_valid_length, q_seq_lens), and it runs in MindSpore's predict phase:
    `prefill` (prompt: every sequence from position 0, FlashAttentionScore) or `increment` (decode
    rows, chunks, mixed steps: PagedAttention); it also returns every row's final hidden state. A
    predict-phase cell keeps one compiled graph per phase and runs it for any call, so its inputs
    are dynamic (set_inputs), as vllm-mindspore's."""

    def __init__(self, model: DecoderModel, prompt: bool):
        super().__init__()
        self.model = model
        self.prompt = prompt
        self.phase = "prefill" if prompt else "increment"
        dtype = model.dtype
        self.set_inputs(
            *(Tensor(shape=[None], dtype=ms.int32) for _ in range(5)),  # up to q_seq_lens
            Tensor(shape=[None, None], dtype=ms.int32),  # block_tables
            Tensor(shape=[None, None], dtype=dtype),  # attn_mask
            Tensor(shape=[None], dtype=ms.int32),  # logit_rows
        )

    def construct(
        self,
        input_ids,
        positions,
        slot_mapping,
        batch_valid_length,
        q_seq_lens,
        block_tables,
        attn_mask,
        logit_rows,
    ):
        x, cos, sin = self.model.embed_tokens(input_ids, positions)
        paging = (slot_mapping, batch_valid_length, q_seq_lens, block_tables, attn_mask)
        for layer in self.model.layers:
            x = layer.paged(x, cos, sin, self.model.rot, paging, layer.k_cache, layer.v_cache, self.prompt)
        logits, hidden = self.model.head(x, logit_rows)
        logits, greedy = logits_and_argmax(logits)
        return logits, greedy, hidden


class ArgmaxGraph(nn.Cell):
    """Greedy post-process: logits [B, V] -> token ids [B]."""

    def construct(self, logits):
        return ops.argmax(logits, -1).astype(ms.int32)


class TopKGraph(nn.Cell):
    """Sampling post-process: logits [B, V] -> the k best (values, ids), best first."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def construct(self, logits):
        values, ids = ops.topk(logits, self.k, -1, True, True)
        return values, ids.astype(ms.int32)


class KVExportGraph(nn.Cell):
    """PD disaggregation, sending side: cache rows -> their K and V in every layer, [2 * layers, N, w]
    (w: a row's width, cache_format.py)."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model

    def construct(self, rows):
        """rows: GraphInputs.kv_rows (the paged cache's [N, 2] (block, offset): [2 * layers, N, KV, w])."""
        blocks = []
        for layer in self.model.cache_layers:
            for cache in (layer.k_cache, layer.v_cache):
                blocks.append(ops.gather_nd(cache, rows) if self.model.paged else ops.gather(cache, rows, 0))
        return ops.stack(blocks)


class KVImportGraph(nn.Cell):
    """PD disaggregation, receiving side: K and V [2 * layers, N, w] written into cache rows."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model

    def construct(self, rows, blocks):
        """rows and blocks as KVExportGraph's."""
        for i, layer in enumerate(self.model.cache_layers):
            if self.model.paged:
                ops.scatter_nd_update(layer.k_cache, rows, blocks[2 * i])
                ops.scatter_nd_update(layer.v_cache, rows, blocks[2 * i + 1])
            else:
                ops.scatter_update(layer.k_cache, rows, blocks[2 * i])
                ops.scatter_update(layer.v_cache, rows, blocks[2 * i + 1])
        return rows


class StateExportGraph(nn.Cell):
    """PD disaggregation, sending side: a slot's Gated DeltaNet states -> its conv inputs [layers,
    conv_state] and recurrent matrices [layers, recurrent_state] (each layer's row of the slot)."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model

    def construct(self, slot):
        """slot: int32 [1]."""
        conv = [ops.gather(layer.conv_state, slot, 0) for layer in self.model.state_layers]
        recurrent = [ops.gather(layer.recurrent_state, slot, 0) for layer in self.model.state_layers]
        return ops.concat(conv), ops.concat(recurrent)


class StateImportGraph(nn.Cell):
    """PD disaggregation, receiving side: StateExportGraph's arrays written into a slot's states."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model

    def construct(self, slot, conv, recurrent):
        for i, layer in enumerate(self.model.state_layers):
            ops.scatter_update(layer.conv_state, slot, conv[i : i + 1])
            ops.scatter_update(layer.recurrent_state, slot, recurrent[i : i + 1])
        return slot


def topk_buckets(vocab: int) -> list[int]:
    """The k of each top-k graph: a request needing k candidates runs the smallest k' >= k."""
    return sorted({k for k in (8, 64, 512, 4096) if k < vocab} | {vocab})


def as_tensors(arrays: tuple[np.ndarray, ...]) -> tuple[Tensor, ...]:
    return tuple(Tensor(a) for a in arrays)


class StepGraphs:
    """The step graphs built from code over one DecoderModel (weights and KV cache as Parameters), and
    the KV transfer graphs: agent.graphs.interface.KVTransferGraphs for ModelRunner."""

    def __init__(self, checkpoint: Checkpoint, runtime: RuntimeSection, split: TensorSplit = WHOLE_MODEL):
        self.spec = checkpoint.spec
        int8 = runtime.activations == "int8"
        if int8 and not has_int8_products():
            raise ValueError(
                "runtime.activations: int8 needs kernels built with AVX2 or AVX512-VNNI (a CPU without "
                f"either, or {TARGET_ENV}={kernel_target()}); use float32"
            )
        ring = local_ring_blocks(runtime, self.spec)
        self.model = DecoderModel(
            checkpoint,
            pool_blocks(runtime),
            runtime.block_size,
            runtime.planned_max_seq_len,
            CpuKernels(
                runtime.attention_kernel,
                runtime.matmul_kernel,
                self.spec.head_dim,
                self.spec.hidden_size,
                int8,
            ),
            getattr(ms, runtime.dtype),
            split,
            local_blocks=(runtime.planned_num_slots + 1) * ring,
            states=StateSlots.of(runtime) if self.spec.linear_attention else NO_STATES,
            paged=paged_backend(runtime),
            cache=CacheFormat.of(runtime),
            device_target=runtime.device_target,
        )
        release_freed_memory()
        if int8 and not any(
            layer.kernel_layer is not None and set(layer.formats.asnumpy().tolist()) - FLOAT_FORMATS
            for layer in self.model.layers
        ):
            raise ValueError(
                "runtime.activations: int8 applies to layer matrices in a quantized GGUF format (Q4_0 to "
                "Q8_0, Q2_K to Q6_K) run by the fused kernel, and this model has none (float weights or "
                "tensor parallelism); use float32"
            )
        self.inputs = GraphInputs(
            runtime,
            self.model.kv_heads,
            self.spec.group_size,
            fused_layers=self.model.layers[0].kernel_layer is not None or runtime.paged_attention,
            ring_blocks=ring,
            state_slots=self.model.recurrent,
        )
        if self.model.paged:  # one graph a phase: prompts, and every other step
            self.prefill_graph: nn.Cell = PagedStepGraph(self.model, prompt=True)
            self.decode_graph: nn.Cell = PagedStepGraph(self.model, prompt=False)
            self.mixed_graph: nn.Cell = self.decode_graph
        else:
            self.prefill_graph = PrefillGraph(self.model)
            self.mixed_graph = MixedStepGraph(self.prefill_graph)
            self.decode_graph = DecodeGraph(self.model)
        self.argmax_graph = ArgmaxGraph()
        self.kv_export_graph = KVExportGraph(self.model)
        self.kv_import_graph = KVImportGraph(self.model)
        self.state_export_graph = StateExportGraph(self.model)
        self.state_import_graph = StateImportGraph(self.model)
        self.topk_buckets = topk_buckets(self.spec.vocab_size)
        # the final hidden states of the last prefill or mixed call's rows (PoolingGraphs)
        self.hidden: Tensor | None = None
        self.projection = tuple(
            np.asarray(checkpoint.tensors[name], np.float32)
            for name in PROJECTIONS
            if name in checkpoint.tensors
        )
        self.topk_graphs = {k: TopKGraph(k) for k in self.topk_buckets}
        dynamic_rows = Tensor(
            shape=[None, self.spec.vocab_size], dtype=ms.float32
        )  # one graph for every batch
        post_process: list[nn.Cell] = [self.argmax_graph, *self.topk_graphs.values()]
        for graph in post_process:
            graph.set_inputs(dynamic_rows)

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
        """One cell for every bucket `length`: MindSpore compiles a graph per input shape."""
        inputs = self.inputs.prefill(table, tokens, length, start, slot, every_row, moves)
        if self.model.paged:
            graph = self.prefill_graph if start == 0 else self.decode_graph
            logits, _, self.hidden = graph(*self.paged_tensors(inputs))
        else:
            logits, self.hidden = self.prefill_graph(*as_tensors(inputs))
        return logits

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
        inputs = self.inputs.decode(tables, tokens, positions, rows, attend, slots, moves)
        if self.model.paged:
            logits, greedy, _ = self.decode_graph(*self.paged_tensors(inputs))
            return logits, greedy
        return self.decode_graph(*as_tensors(inputs))

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
        """The prefill graph with the step's tables and `logit_rows`: one graph per (rows, logit_rows)."""
        inputs = self.inputs.mixed(
            decode_tables, decode_tokens, decode_positions, chunks, rows, logit_rows, decode_slots, moves
        )
        tensors = self.paged_tensors(inputs) if self.model.paged else as_tensors(inputs)
        logits, greedy, self.hidden = self.mixed_graph(*tensors)
        return logits, greedy

    def paged_tensors(self, inputs: tuple[np.ndarray, ...]) -> tuple[Tensor, ...]:
        """GraphInputs.paged_step's arrays as PagedStepGraph's inputs: the mask in the model's dtype."""
        tensors = list(as_tensors(inputs))
        tensors[6] = Tensor(inputs[6], dtype=self.model.dtype)
        return tuple(tensors)

    def argmax(self, logits: Tensor) -> Tensor:
        return self.argmax_graph(logits)

    def topk(self, k: int, logits: Tensor) -> tuple[Tensor, Tensor]:
        return self.topk_graphs[k](logits)

    def kv_export(self, table: np.ndarray, length: int) -> np.ndarray:
        self._check_transfers()
        blocks = self.kv_export_graph(Tensor(self.inputs.kv_rows(table, length))).asnumpy()
        if self.model.paged:  # position-major in the paged cache
            return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3))
        return blocks.reshape(len(blocks), self.inputs.kv_heads, length, self.row_width)

    def kv_import(self, table: np.ndarray, blocks: np.ndarray) -> None:
        self._check_transfers()
        rows = Tensor(self.inputs.kv_rows(table, blocks.shape[2]))
        if self.model.paged:
            rows_of = np.ascontiguousarray(blocks.transpose(0, 2, 1, 3))
        else:
            rows_of = blocks.reshape(len(blocks), -1, self.row_width)
        self.kv_import_graph(rows, Tensor(rows_of)).asnumpy()

    def state_export(self, slot: int) -> list[np.ndarray]:
        if not self.model.state_layers:
            return []
        conv, recurrent = self.state_export_graph(Tensor(np.array([slot], np.int32)))
        return [conv.asnumpy(), recurrent.asnumpy()]

    def state_import(self, slot: int, states: list[np.ndarray]) -> None:
        if self.model.state_layers:
            slots = Tensor(np.array([slot], np.int32))
            self.state_import_graph(slots, *(Tensor(state) for state in states)).asnumpy()

    @property
    def row_width(self) -> int:
        """A cache row's elements: the head dim, or a q8_0 row's bytes."""
        return self.model.cache_format.row_width(self.spec.head_dim)

    def _check_transfers(self) -> None:
        if self.inputs.ring:
            raise ValueError(
                "a model with sliding-window layers keeps their KV in per-slot rings that a transfer "
                "does not move: serve it with mixed groups (no prefill/decode disaggregation)"
            )

    def cache_bytes(self) -> int:
        return self.model.cache_bytes()
