"""A tensor-parallel rank's share of the model, without MindSpore: the loaders read only these rows
and columns of the files (agent/model/formats/), the graphs hold them (agent/graphs/layers.py).

Each rank of a group holds a contiguous run of KV heads with their query heads (Q/K/V rows, the
matching columns of wo) and of FFN columns (gate/up rows, down columns), in a mixture-of-experts layer
of every expert's (the router whole); the embedding, norms and lm_head are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.model.spec import ModelSpec

# Canonical tensor names by the part a rank holds: its rows (output features) or its columns
Q_ROWS, KV_ROWS, FFN_ROWS = (".wq", ".bq"), (".wk", ".wv", ".bk", ".bv"), (".w_gate", ".w_up")
Q_COLUMNS, FFN_COLUMNS = ".wo", ".w_down"
EXPERTS = ".experts."  # a MoE layer's experts' matrices: layers.<i>.experts.<e>.w_gate ...


@dataclass(frozen=True)
class TensorSplit:
    """This process's share of a tensor-parallel group (rank of size); size 1: the whole model."""

    rank: int = 0
    size: int = 1

    def share(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's contiguous share of `total` items (the first ranks get the
        remainder: 3 KV heads over 2 ranks are 2 + 1)."""
        base, extra = divmod(total, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)


WHOLE_MODEL = TensorSplit()  # no tensor parallelism: the process runs the whole model


@dataclass(frozen=True)
class LayerShare:
    """The rows and columns of a layer's matrices that one rank holds: its KV heads with their query
    heads, and its FFN columns (a dense FFN's, and each expert's)."""

    kv_heads: int
    q_rows: slice  # of wq and bq (columns of wo)
    kv_rows: slice  # of wk, wv, bk, bv
    ffn: slice  # rows of w_gate and w_up, columns of w_down
    expert_ffn: slice  # the same of every expert's (experts.<e>.w_gate ...)

    @classmethod
    def of(cls, spec: ModelSpec, split: TensorSplit) -> LayerShare:
        hd, group = spec.head_dim, spec.group_size
        kv_start, kv_end = split.share(spec.num_kv_heads)
        ffn_start, ffn_end = split.share(spec.intermediate_size)
        expert_start, expert_end = split.share(spec.expert_intermediate_size)
        return cls(
            kv_end - kv_start,
            slice(kv_start * group * hd, kv_end * group * hd),
            slice(kv_start * hd, kv_end * hd),
            slice(ffn_start, ffn_end),
            slice(expert_start, expert_end),
        )

    def held_as(self, loaded: TensorSplit, split: TensorSplit) -> LayerShare:
        """This share within a checkpoint loaded as `loaded`: the whole model's rows and columns as
        they are, or all of a checkpoint that holds this very share (its loader cut them)."""
        if loaded.size == 1:
            return self
        if loaded != split:
            raise ValueError(f"the checkpoint holds rank {loaded.rank} of {loaded.size}, not {split}")
        return LayerShare(
            self.kv_heads,
            slice(0, self.q_rows.stop - self.q_rows.start),
            slice(0, self.kv_rows.stop - self.kv_rows.start),
            slice(0, self.ffn.stop - self.ffn.start),
            slice(0, self.expert_ffn.stop - self.expert_ffn.start),
        )

    def cut(self, name: str) -> tuple[slice | None, slice | None]:
        """(rows, columns) of the canonical tensor `name` this rank holds; None: all of them."""
        ffn = self.expert_ffn if EXPERTS in name else self.ffn
        if name.endswith(FFN_ROWS):
            return ffn, None
        if name.endswith(FFN_COLUMNS):
            return None, ffn
        if name.endswith(Q_ROWS):
            return self.q_rows, None
        if name.endswith(KV_ROWS):
            return self.kv_rows, None
        if name.endswith(Q_COLUMNS):
            return None, self.q_rows
        return None, None
