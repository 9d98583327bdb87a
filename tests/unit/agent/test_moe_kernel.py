"""The mixture-of-experts op (agent/kernels/moe.cc MoeFfn) called straight through its C entry
point: against a float64 numpy MoE (RMSNorm, router softmax, top-k, renormalised or not, SwiGLU
experts) for float32 and Q8_0 experts at every kernel target, row counts from 1 to 40 with padding
rows; experts no row chooses are never read (NaN weights there leave the output finite); inputs
that do not fit are refused."""

import ctypes

import gguf
import numpy as np
import pytest

from agent.kernels import build
from agent.model.quantized import F32, BlockMatrix
from kernel_calls import call

D, FE, E = 64, 96, 8
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture
def moe_ffn(kernel_target):
    return ctypes.CDLL(str(build(kernel_target))).MoeFfn


@pytest.fixture
def moe_ffn_native():
    return ctypes.CDLL(str(build())).MoeFfn


def experts(rng: np.random.Generator, qtype) -> dict[str, list[BlockMatrix]]:
    shapes = {"w_gate": (FE, D), "w_up": (FE, D), "w_down": (D, FE)}
    out = {}
    for name, (rows, cols) in shapes.items():
        values = (rng.standard_normal((E, rows, cols)) * cols**-0.5).astype(np.float32)
        if qtype == F32:
            out[name] = [BlockMatrix.from_float(v) for v in values]
        else:
            out[name] = [BlockMatrix.from_gguf(qtype, gguf.quants.quantize(v, qtype), cols) for v in values]
    return out


def reference(x, norm, router, matrices, top_k, normalise, live, eps=1e-6) -> np.ndarray:
    x = x.astype(np.float64)
    h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * norm
    logits = h @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = x.copy()
    for row in range(live):
        chosen = np.argsort(-probs[row], kind="stable")[:top_k]
        weights = probs[row, chosen] / (probs[row, chosen].sum() if normalise else 1)
        for e, w in zip(chosen, weights):
            gate, up, down = (
                matrices[n][e].dequantize().astype(np.float64) for n in ("w_gate", "w_up", "w_down")
            )
            g = gate @ h[row]
            out[row] += w * down @ (g / (1 + np.exp(-g)) * (up @ h[row]))
    return out


def run(moe_ffn, x, lengths, norm, router, matrices, top_k, normalise) -> tuple[int, np.ndarray]:
    formats = np.array([F32] + [matrices[n][0].qtype for n in ("w_gate", "w_up", "w_down")], np.int32)
    stacks = [np.stack([m.packed for m in matrices[n]]) for n in ("w_gate", "w_up", "w_down")]
    out = np.full_like(x, np.nan)
    inputs = [
        x,
        lengths,
        np.array([1e-6], np.float32),
        norm,
        BlockMatrix.from_float(router).packed,
        *stacks,
        formats,
        np.array([top_k, int(normalise)], np.int32),
    ]
    return call(moe_ffn, inputs, out), out


@pytest.mark.parametrize("qtype", [F32, Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("top_k, normalise", [(2, True), (3, False), (1, True)])
def test_rows_get_their_chosen_experts_weighted_sum(moe_ffn, qtype, top_k, normalise):
    rng = np.random.default_rng(top_k)
    matrices = experts(rng, qtype)
    router = rng.standard_normal((E, D)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    for rows, live in ((1, 1), (5, 3), (40, 37)):
        x = rng.standard_normal((rows, D)).astype(np.float32)
        lengths = np.repeat(np.where(np.arange(rows) < live, 7, 0), 2).astype(np.int32)  # 2 KV heads
        status, out = run(moe_ffn, x, lengths, norm, router, matrices, top_k, normalise)
        assert status == 0
        expected = reference(x, norm, router, matrices, top_k, normalise, live)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
        assert np.array_equal(out[live:], x[live:])  # padding rows pass through


def test_experts_no_row_chooses_are_never_read(moe_ffn_native):
    """A router that sends every row to experts 0 and 1: the other experts' weights are NaN, and the
    output is the two experts' (finite, equal to the reference without the poison)."""
    rng = np.random.default_rng(9)
    matrices = experts(rng, F32)
    router = np.zeros((E, D), np.float32)
    router[:2] = 0.5  # rows of positive activations: experts 0 and 1 win by far
    norm = np.ones(D, np.float32)
    x = np.abs(rng.standard_normal((6, D))).astype(np.float32)
    lengths = np.ones(6, np.int32)
    expected = reference(x, norm, router, matrices, 2, True, 6)
    for name in matrices:
        for e in range(2, E):
            matrices[name][e] = BlockMatrix(
                F32, matrices[name][e].shape, np.full_like(matrices[name][e].packed, np.nan)
            )
    status, out = run(moe_ffn_native, x, lengths, norm, router, matrices, 2, True)
    assert status == 0 and np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("top_k", [0, E + 1])
def test_a_top_k_outside_the_experts_is_refused(moe_ffn_native, top_k):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, D)).astype(np.float32)
    router = rng.standard_normal((E, D)).astype(np.float32)
    status, _ = run(
        moe_ffn_native,
        x,
        np.ones(2, np.int32),
        np.ones(D, np.float32),
        router,
        experts(rng, F32),
        top_k,
        True,
    )
    assert status == 1
