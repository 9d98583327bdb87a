"""Warm-up: every graph an agent runs is compiled (or loaded from the compile cache) and run once on
the scratch blocks before the agent reports ready, with the known-answer probe as its input
(agent/known_answer.py: a numpy forward of the same weights); each output is checked against it, so
graphs that do not fit the weights (a stale compile cache, a kernel built for other formats) stop
the agent instead of serving wrong answers.

    seconds = warm_up(runner, progress, role, known=KnownAnswer.of_checkpoint(checkpoint, runtime))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
from mindspore import Tensor

from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk
from agent.graphs.cache_format import dequantize_rows, quantize_rows
from agent.graphs.interface import MixedStepGraphs, StateMove, StateMoves
from agent.known_answer import (
    KnownAnswer,
    KnownAnswerError,
    check_post_process,
    compare,
    probe_length,
    probe_tokens,
)
from agent.runner import ModelRunner

log = logging.getLogger(__name__)


def graph_shapes(runner: ModelRunner, role: str = "mixed") -> list[tuple[str, int, int]]:
    """(kind, rows, length) of every graph an agent of `role` runs, in warm-up order: what
    writes the probe's K/V into the scratch slot (prefill, KV import) before what reads it."""
    rt = runner.runtime
    shapes = [] if role == "decode" else [("prefill", 1, s) for s in rt.prefill_buckets]
    if role == "decode":
        shapes += [("kv_import", 1, s) for s in rt.prefill_buckets]
    if role != "prefill":
        attends = runner.graphs.inputs.decode_attends
        shapes += [("decode", b, a) for b in rt.decode_batch_buckets for a in attends]
    if role == "mixed" and runner.mixed_rows:
        shapes += [("mixed", b, runner.mixed_rows) for b in rt.decode_batch_buckets]
    shapes += [("argmax", 0, 0)] + [("topk", 0, k) for k in runner.topk_buckets]
    if role == "prefill":
        shapes += [("kv_export", 1, s) for s in rt.prefill_buckets]
    return shapes


def warm_up(
    runner: ModelRunner,
    progress: Callable[[str], None] = log.info,
    role: str = "mixed",
    known: KnownAnswer | None = None,
) -> float:
    """Compile (or load from the compile cache) and run every graph once, on the scratch slot,
    with the known-answer probe as input; with `known`, each output is checked against it
    (agent/known_answer.py) and a graph that disagrees raises KnownAnswerError."""
    start = time.perf_counter()
    shapes = graph_shapes(runner, role)
    zeros = np.zeros(runner.spec.vocab_size, np.float32)
    probe = known or KnownAnswer(
        probe_tokens(runner.spec.vocab_size, probe_length(runner.runtime)), zeros, zeros
    )
    for i, (kind, rows, length) in enumerate(shapes, 1):
        t0 = time.perf_counter()
        label = {
            "prefill": f"prefill length {length}",
            "decode": f"decode batch {rows}" + (f" attend {length}" if length else ""),
            "mixed": f"mixed step of {rows} sequences in {length} rows",
            "argmax": "argmax",
            "topk": f"top-k {length}",
            "kv_export": f"KV export {length}",
            "kv_import": f"KV import {length}",
        }[kind]
        try:
            _run_probe(runner, kind, rows, length, probe, label if known is not None else None)
        except KnownAnswerError:
            raise  # it names the graph, and whether int8 is the cause (the agent's remedy depends on it)
        except RuntimeError as exc:
            if known is None:
                raise
            # a kernel refuses inputs of other shapes or formats than the graph was built for
            raise KnownAnswerError(f"the {label} graph failed on the probe ({exc})") from exc
        progress(f"graph {i}/{len(shapes)} {label}: {time.perf_counter() - t0:.1f}s")
    elapsed = time.perf_counter() - start
    progress(
        f"warm-up done: {len(shapes)} graphs in {elapsed:.1f}s"
        + (", each agreeing with the numpy forward of the weights" if known is not None else "")
    )
    return elapsed


def _run_probe(
    runner: ModelRunner, kind: str, rows: int, length: int, probe: KnownAnswer, check: str | None
) -> None:
    """One graph on the probe (the prompt at positions 0..n-1 of the scratch slot, the decode token
    at n); `check`: the graph's label, to compare its output with `probe`."""
    scratch, dtype = runner.graphs.inputs.scratch_table, runner.runtime.dtype
    expected = np.stack([probe.prefill_logits, probe.decode_logits])
    # the tolerance the layers' outputs are held to (int8 activations round every product's input)
    quantized_kv = runner.runtime.kv_cache_dtype == "q8_0"
    held_to = "int8" if runner.runtime.activations == "int8" else "q8_0" if quantized_kv else dtype

    if kind == "prefill":
        got = runner.graphs.prefill(scratch, probe.prompt, length).asnumpy()[0]
        if check:
            _compare_prompt_row(runner, check, got, len(probe.prompt) - 1, probe, held_to)
    elif kind == "decode":
        _run_decode_probe(runner, rows, length, probe, check, held_to)
    elif kind == "mixed":  # the probe's prompt as a chunk and rows - 1 decode rows after it
        _run_mixed_probe(runner, rows, length, probe, check, held_to)
    elif kind in ("kv_export", "kv_import"):
        _run_transfer_probe(runner, kind, length, probe, check, held_to)
    elif kind == "argmax":
        ids = runner.graphs.argmax(Tensor(expected)).asnumpy()
        if check:
            check_post_process(check, expected, ids)
    else:
        values, ids = (t.asnumpy() for t in runner.graphs.topk(length, Tensor(expected)))
        if check:
            check_post_process(check, expected, ids, values)


def _run_transfer_probe(
    runner: ModelRunner, kind: str, length: int, probe: KnownAnswer, check: str | None, held_to: str
) -> None:
    """A KV export of the probe's prompt from the scratch slot (with its Gated DeltaNet states,
    each checked), or the probe's K/V and states imported into it (then read by the decode probes)."""
    scratch, n = runner.graphs.inputs.scratch_table, len(probe.prompt)
    quantized_kv = runner.runtime.kv_cache_dtype == "q8_0"
    if kind == "kv_export":
        blocks = runner.kv_graphs().kv_export(scratch, length)[:, :, :n]
        if check and probe.kv is not None:
            compare(check, dequantize_rows(blocks) if quantized_kv else blocks, probe.kv, held_to)
        states = runner.kv_graphs().state_export(runner.graphs.inputs.num_slots)  # the scratch slot's
        if check and probe.states:
            for got, expected in zip(states, probe.states):
                compare(f"{check} (Gated DeltaNet states)", got, expected, held_to)
    else:
        layers, heads = runner.spec.attention_layers, runner.graphs.inputs.kv_heads
        blocks = np.zeros((2 * layers, heads, length, runner.cache_row_width()), runner.cache_dtype())
        if probe.kv is not None:  # the decode graphs then read it: a wrong import fails their check
            blocks[:, :, :n] = quantize_rows(probe.kv) if quantized_kv else probe.kv
        runner.kv_graphs().kv_import(scratch, blocks)
        if probe.states:  # the decode probes restore their slots' states from the scratch slot's
            runner.kv_graphs().state_import(runner.graphs.inputs.num_slots, list(probe.states))


def _run_decode_probe(
    runner: ModelRunner, rows: int, length: int, probe: KnownAnswer, check: str | None, held_to: str
) -> None:
    """`rows` copies of the probe's decode step, each row's logits and argmax checked."""
    scratch, n = runner.graphs.inputs.scratch_table, len(probe.prompt)
    slots, moves = _probe_states(runner, rows)
    real = len(slots) if slots is not None else rows
    logits, greedy = runner.graphs.decode(
        np.tile(scratch, (real, 1)),
        np.full(real, probe.decode_token),
        np.full(real, n),
        rows,
        length,
        slots=slots,
        moves=moves,
    )
    if check:
        got = logits.asnumpy()[:real]
        for row in got:
            compare(check, row, probe.decode_logits, held_to)
        # int8 products may reorder near-equal logits: the graph's argmax is of its own
        chosen_from = got if held_to == "int8" else np.tile(probe.decode_logits, (real, 1))
        check_post_process(check, chosen_from, greedy.asnumpy()[:real])


def _probe_states(runner: ModelRunner, rows: int, first: int = 0) -> tuple[list[int] | None, StateMoves]:
    """Where a model has Gated DeltaNet layers, the probe's decode rows need a state each, the one
    the prompt left in the scratch slot (which must stay as it is for the next probe): slots from
    `first` on (free at warm-up), each restored from it, as many rows as there are slots. (None, {})
    elsewhere."""
    inputs = runner.graphs.inputs
    if not inputs.state_slots:
        return None, {}
    slots = list(range(first, min(first + rows, inputs.num_slots)))
    return slots, {slot: StateMove(restore=inputs.num_slots) for slot in slots}


def _run_mixed_probe(
    runner: ModelRunner, rows: int, length: int, probe: KnownAnswer, check: str | None, held_to: str
) -> None:
    """The probe's prompt as a chunk and rows - 1 decode rows after it, each row's logits checked."""
    assert isinstance(runner.graphs, MixedStepGraphs)
    scratch, n = runner.graphs.inputs.scratch_table, len(probe.prompt)
    slots, moves = _probe_states(runner, rows - 1, first=1)  # slot 0: the chunk's
    decodes = len(slots) if slots is not None else rows - 1
    logits, greedy = runner.graphs.mixed(
        np.tile(scratch, (decodes, 1)),
        np.full(decodes, probe.decode_token),
        np.full(decodes, n),
        [StepChunk(0, list(probe.prompt), scratch, 0, SamplingParams())],
        length,
        rows,
        decode_slots=slots,
        moves=moves,
    )
    if check:
        got = logits.asnumpy()
        _compare_prompt_row(runner, check, got[decodes], decodes + len(probe.prompt) - 1, probe, held_to)
        for row in got[:decodes] if probe.prefill_hidden is None else ():
            compare(check, row, probe.decode_logits, held_to)
        check_post_process(check, got, greedy.asnumpy())


def _compare_prompt_row(
    runner: ModelRunner, check: str, logits: np.ndarray, row: int, probe: KnownAnswer, held_to: str
) -> None:
    """The probe prompt's last row (`row` of the call) against the numpy forward's: its logits, or
    an encoder's final hidden state (its prefill and mixed graphs run no LM head: zero logits)."""
    if probe.prefill_hidden is None:
        compare(check, logits, probe.prefill_logits, held_to)
        return
    hidden = getattr(runner.graphs, "hidden", None)  # PoolingGraphs'; MindIR graphs keep none
    if hidden is None:
        raise KnownAnswerError(f"the {check} graph of an encoder returned no hidden states")
    compare(check, hidden.asnumpy()[row], probe.prefill_hidden, held_to)
