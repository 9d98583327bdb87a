"""Whole blocks' K/V between a runner's KV pool and the prefix cache's second tier
(agent/kv_tiers.py), through the KV transfer graphs that PD disaggregation uses.

    layout = tier_layout(runner)
    store = open_tier_store(runner, checkpoint, host_bytes, disk_bytes, root)
    kvs = export_blocks(runner, [7, 3])       # each [2 * layers, KV heads, block_size, row width]
    import_blocks(runner, [12, 5], kvs)       # written into other blocks: a later hit reads them

A block's K/V does not depend on where it sits in the pool (the positions are in the K rotation,
which a block keeps), so a block exported from one block id may be imported into any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agent.compile_cache import weights_fingerprint
from agent.graphs.interface import bucket
from agent.kv_tiers import KVLayout, KVTierStore
from agent.model.checkpoint import Checkpoint
from agent.runner import ModelRunner, RunnerError


def open_tier_store(
    runner: ModelRunner, checkpoint: Checkpoint, host_bytes: int, disk_bytes: int, root: Path
) -> KVTierStore:
    """The runner's tier store: its files in a folder of `root` per model (the weights' fingerprint,
    which each file's header also names), so models never share a folder."""
    identity = weights_fingerprint(checkpoint)
    folder = root / identity[:16] if disk_bytes else None
    return KVTierStore(tier_layout(runner), identity, host_bytes, disk_bytes, folder)


def tier_layout(runner: ModelRunner) -> KVLayout:
    """The layout of one block's K/V as the transfer graphs give it; refused where they cannot."""
    if runner.runtime.dtype == "bfloat16":
        raise RunnerError("the KV tiers do not hold a bfloat16 cache (NumPy has no bfloat16)")
    size = runner.graphs.inputs.block_size
    largest = runner.runtime.prefill_buckets[-1]
    if size > largest:
        raise RunnerError(
            f"the KV tiers move whole blocks: the largest prefill bucket ({largest}) must hold one "
            f"({size} positions)"
        )
    return KVLayout(
        layers=runner.spec.num_layers,
        kv_heads=runner.graphs.inputs.kv_heads,
        head_dim=runner.spec.head_dim,
        row_width=runner.cache_row_width(),
        block_size=size,
        dtype=np.dtype(runner.cache_dtype()).name,
        kernel_layout="paged"
        if getattr(getattr(runner.graphs, "model", None), "paged", False)
        else "contiguous",
    )


def export_blocks(runner: ModelRunner, blocks: Sequence[int]) -> list[np.ndarray]:
    """The K/V of each of `blocks` (pool block ids), in order."""
    out: list[np.ndarray] = []
    for group, table, size in _groups(runner, blocks):
        kv = runner.kv_graphs().kv_export(table, size)
        width = runner.graphs.inputs.block_size
        out += [np.ascontiguousarray(kv[:, :, i * width : (i + 1) * width]) for i in range(len(group))]
    return out


def import_blocks(runner: ModelRunner, blocks: Sequence[int], kvs: Sequence[np.ndarray]) -> None:
    """Each of `kvs` (as export_blocks gives them) written into the pool block of `blocks` at its index."""
    if len(blocks) != len(kvs):
        raise RunnerError(f"{len(kvs)} blocks' K/V for {len(blocks)} block ids")
    layout = tier_layout(runner)
    done = 0
    for group, table, size in _groups(runner, blocks):
        padded = np.zeros((*layout.shape[:2], size, layout.row_width), layout.dtype)
        for i, kv in enumerate(kvs[done : done + len(group)]):
            if kv.shape != layout.shape or kv.dtype != np.dtype(layout.dtype):
                raise RunnerError(
                    f"a block's K/V is {layout.dtype}{list(layout.shape)}, not {kv.dtype}{list(kv.shape)}"
                )
            padded[:, :, i * layout.block_size : (i + 1) * layout.block_size] = kv
        # the padding positions past the group fall in the scratch blocks of the table
        runner.kv_graphs().kv_import(table, padded)
        done += len(group)


def _groups(runner: ModelRunner, blocks: Sequence[int]) -> list[tuple[Sequence[int], np.ndarray, int]]:
    """`blocks` in groups that one transfer graph call moves: (the group, a table that starts with
    it, scratch blocks after, the graph's bucket of positions)."""
    layout = tier_layout(runner)
    inputs = runner.graphs.inputs
    if any(not 0 <= b < runner.num_blocks for b in blocks):
        raise RunnerError(f"block ids are 0..{runner.num_blocks - 1}")
    per_call = runner.runtime.prefill_buckets[-1] // layout.block_size
    groups = []
    for start in range(0, len(blocks), per_call):
        group = blocks[start : start + per_call]
        table = inputs.scratch_table.copy()
        table[: len(group)] = group
        groups.append((group, table, bucket(runner.runtime.prefill_buckets, len(group) * layout.block_size)))
    return groups
