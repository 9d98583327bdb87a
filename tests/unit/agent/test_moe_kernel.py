"""The mixture-of-experts op (agent/kernels/moe.cc MoeFfn) called straight through its C entry
point: against a float64 numpy MoE (RMSNorm, router softmax, top-k, renormalised or not, SwiGLU
experts) for float32 and Q8_0 experts at every kernel target, row counts from 1 to 40 with padding
rows; experts no row chooses are never read (NaN weights there leave the output finite); inputs
that do not fit are refused. MoeFfnI8 (int8 activations): against the reference whose experts'
inputs are rounded per block of 32, float experts left float32, a row bit-identical in every batch."""

import ctypes

import gguf
import numpy as np
import pytest

from agent.kernels import build, has_int8_products
from agent.model.quantized import F32, BlockMatrix
from kernel_calls import call
from reference_numpy import q8_1
from tools.make_gguf import random_blocks

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


def swiglu_expert(matrices: dict[str, BlockMatrix], h: np.ndarray) -> np.ndarray:
    """One SwiGLU expert's output for a normed row h, in float64."""
    gate, up, down = (matrices[n].dequantize().astype(np.float64) for n in ("w_gate", "w_up", "w_down"))
    g = gate @ h
    return down @ (g / (1 + np.exp(-g)) * (up @ h))


def reference(x, norm, router, matrices, top_k, normalise, live, eps=1e-6, shared=None) -> np.ndarray:
    """shared: a shared expert's matrices and its "gate" vector (Qwen3.5-MoE's), which every row
    runs beside its k, weighted by sigmoid(h . gate)."""
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
            out[row] += w * swiglu_expert({n: m[e] for n, m in matrices.items()}, h[row])
        if shared is not None:
            weight = 1 / (1 + np.exp(-h[row] @ shared["gate"]))
            out[row] += weight * swiglu_expert(shared, h[row])
    return out


def run(moe_ffn, x, lengths, norm, router, matrices, top_k, normalise, shared=None) -> tuple[int, np.ndarray]:
    names = ("w_gate", "w_up", "w_down")
    formats = [F32] + [matrices[n][0].qtype for n in names]
    stacks = [np.stack([m.packed for m in matrices[n]]) for n in names]
    extra = []
    if shared is not None:
        formats += [shared[n].qtype for n in names]
        extra = [shared["gate"].astype(np.float32), *(shared[n].packed for n in names)]
    out = np.full_like(x, np.nan)
    inputs = [
        x,
        lengths,
        np.array([1e-6], np.float32),
        norm,
        BlockMatrix.from_float(router).packed,
        *stacks,
        np.array(formats, np.int32),
        np.array([top_k, int(normalise)], np.int32),
        *extra,
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


def shared_expert(rng: np.random.Generator, qtype, ffn: int = FE) -> dict:
    """A shared expert's gate vector and SwiGLU matrices in `qtype`."""
    shapes = {"w_gate": (ffn, D), "w_up": (ffn, D), "w_down": (D, ffn)}
    out: dict = {"gate": rng.standard_normal(D) * D**-0.5}
    for name, (rows, cols) in shapes.items():
        values = (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)
        out[name] = (
            BlockMatrix.from_float(values)
            if qtype == F32
            else BlockMatrix.from_gguf(qtype, gguf.quants.quantize(values, qtype), cols)
        )
    return out


@pytest.mark.parametrize(
    "routed, shared", [(F32, F32), (Q8_0, F32), (F32, Q8_0)], ids=["F32", "Q8_0+F32", "F32+Q8_0"]
)
def test_a_shared_expert_adds_its_sigmoid_weighted_output(moe_ffn, routed, shared):
    """Qwen3.5-MoE's shared expert: every row runs it beside its k routed experts, weighted by
    sigmoid(norm(x) . gate); its format may differ from the routed experts'. Without its gate's
    weighting (or without it at all) the output differs from the reference."""
    rng = np.random.default_rng(11)
    matrices = experts(rng, routed)
    extra = shared_expert(rng, shared)
    router = rng.standard_normal((E, D)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    for rows, live in ((1, 1), (6, 4), (40, 37)):
        x = rng.standard_normal((rows, D)).astype(np.float32)
        lengths = np.where(np.arange(rows) < live, 5, 0).astype(np.int32)
        status, out = run(moe_ffn, x, lengths, norm, router, matrices, 2, True, extra)
        assert status == 0
        expected = reference(x, norm, router, matrices, 2, True, live, shared=extra)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
        assert np.array_equal(out[live:], x[live:])
        routed_only = reference(x, norm, router, matrices, 2, True, live)
        assert np.abs(routed_only[:live] - expected[:live]).max() > 1e-2


@pytest.mark.parametrize(
    "top_k, shared_ffn", [(0, None), (E + 1, None), (2, 2 * FE)], ids=["k=0", "k>E", "shared of another size"]
)
def test_what_does_not_fit_is_refused(moe_ffn_native, top_k, shared_ffn):
    """A top k outside the experts, or a shared expert whose FFN is not the routed experts' size."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, D)).astype(np.float32)
    router = rng.standard_normal((E, D)).astype(np.float32)
    extra = None if shared_ffn is None else shared_expert(rng, F32, ffn=shared_ffn)
    lengths, norm = np.ones(2, np.int32), np.ones(D, np.float32)
    status, _ = run(moe_ffn_native, x, lengths, norm, router, experts(rng, F32), top_k, True, extra)
    assert status == 1


# MoeFfnI8 (runtime.activations int8): the experts' integer-format products take their inputs rounded
# per block of 32 as the dense layers' int8 products do (int8_products.h); the router stays float32.
# (gate/up, down) formats and (hidden, expert FFN) sizes: K-quants' inputs are whole blocks of 256.
INT8_CASES = {
    "Q8_0": ((Q8_0, Q8_0), (64, 96)),
    "Q4_K+Q6_K": ((gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K), (256, 256)),
}


@pytest.fixture
def library(kernel_target):
    return ctypes.CDLL(str(build(kernel_target)))


def block_experts(rng: np.random.Generator, case: str, experts: int = E) -> dict[str, list[BlockMatrix]]:
    """Random file blocks (tools.make_gguf) of each expert's gate, up and down in the case's formats."""
    (inner, down), (d, fe) = INT8_CASES[case]
    shapes = {"w_gate": (inner, fe, d), "w_up": (inner, fe, d), "w_down": (down, d, fe)}
    return {
        name: [BlockMatrix.from_gguf(q, random_blocks(q, rows, cols, rng, 0.1), cols) for _ in range(experts)]
        for name, (q, rows, cols) in shapes.items()
    }


def near_ties(a: np.ndarray) -> int:
    """Values of a that a rounding to the block-of-32 grid meets within 3e-4 of a step from its
    boundary: the kernel's float32 input, a few ulps from the float64 reference's, may round them the
    other way (then its row moves by about a step of one activation)."""
    blocks = a.reshape(-1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scaled = blocks * 127 / np.where(amax > 0, amax, 1)
    return int(np.count_nonzero(np.abs(np.abs(scaled - np.trunc(scaled)) - 0.5) < 3e-4))


def int8_reference(
    x, norm, router, matrices, top_k, normalise, live, eps=1e-6
) -> tuple[np.ndarray, list[int]]:
    """reference() with each expert product's input rounded as reference_numpy.q8_1 rounds the dense
    layers' (the router's input not: it stays float32); and each row's count of near ties."""
    x = x.astype(np.float64)
    h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * norm
    logits = h @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out, ties = x.copy(), []
    for row in range(live):
        chosen = np.argsort(-probs[row], kind="stable")[:top_k]
        weights = probs[row, chosen] / (probs[row, chosen].sum() if normalise else 1)
        hq, tied = q8_1(h[row]), near_ties(h[row])
        for e, w in zip(chosen, weights):
            gate, up, down = (
                matrices[n][e].dequantize().astype(np.float64) for n in ("w_gate", "w_up", "w_down")
            )
            g = gate @ hq
            act = g / (1 + np.exp(-g)) * (up @ hq)
            out[row] += w * down @ q8_1(act)
            tied += near_ties(act)
        ties.append(tied)
    return out, ties


def int8_rows_match_the_reference(op, rng, d: int, norm, router, matrices) -> np.ndarray:
    """MoeFfnI8 (`op`, of any build) on 1 to 40 rows with padding, against int8_reference (tie-free
    rows to float32's reach, far from the float reference) and reference; the last call's input."""
    exact = 0
    for rows, live in ((1, 1), (4, 4), (7, 5), (40, 37)):
        x = (rng.standard_normal((rows, d)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        lengths = np.repeat(np.where(np.arange(rows) < live, 7, 0), 2).astype(np.int32)
        status, out = run(op, x, lengths, norm, router, matrices, 2, True)
        assert status == 0
        assert np.array_equal(out[live:], x[live:])  # padding rows pass through
        want, ties = int8_reference(x, norm, router, matrices, 2, True, live)
        floats = reference(x, norm, router, matrices, 2, True, live)
        for row in range(live):  # the experts' sum, without the residual it is added to
            got, wanted, float_sum = out[row] - x[row], want[row] - x[row], floats[row] - x[row]
            scale = np.abs(wanted).max()
            off = np.abs(got - wanted).max()
            if ties[row] == 0:
                exact += 1
                assert off < 2e-5 * scale, (rows, row, off / scale)
                assert np.abs(got - float_sum).max() > 20 * off, (rows, row)
            else:
                assert off < 1e-2 * scale, (rows, row, off / scale)
    assert exact >= 20
    return x


@pytest.mark.parametrize("case", INT8_CASES)
def test_int8_experts_match_the_block_rounded_reference(library, kernel_target, case):
    """Rows of 1 to 40 (with padding) against the numpy MoE whose experts' inputs are rounded per
    block of 32 (tie-free rows to float32's reach; rows meeting a tie within a few roundings' move),
    and far from the float reference (the int8 products ran). The portable target refuses the call."""
    rng = np.random.default_rng(5)
    matrices = block_experts(rng, case)
    d = INT8_CASES[case][1][0]
    router = rng.standard_normal((E, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    if not has_int8_products(kernel_target):
        x = rng.standard_normal((2, d)).astype(np.float32)
        assert run(library.MoeFfnI8, x, np.ones(2, np.int32), norm, router, matrices, 2, True)[0] == 1
        return
    int8_rows_match_the_reference(library.MoeFfnI8, rng, d, norm, router, matrices)


def test_int8_float_experts_stay_float32_products(library, kernel_target):
    """F32 and F16 experts take float32 activations in MoeFfnI8 too: its output is MoeFfn's, bit
    for bit (the router is float32 in both)."""
    if not has_int8_products(kernel_target):
        pytest.skip("the portable target has no int8 products")
    rng = np.random.default_rng(6)
    for qtype in (F32, gguf.GGMLQuantizationType.F16):
        if qtype == F32:
            matrices = experts(rng, F32)
        else:
            matrices = {
                name: [
                    BlockMatrix.from_gguf(qtype, random_blocks(qtype, r, c, rng, 0.1), c) for _ in range(E)
                ]
                for name, (r, c) in {"w_gate": (FE, D), "w_up": (FE, D), "w_down": (D, FE)}.items()
            }
        router = rng.standard_normal((E, D)).astype(np.float32)
        norm = np.ones(D, np.float32)
        x = rng.standard_normal((9, D)).astype(np.float32)
        lengths = np.ones(9, np.int32)
        status_float, floats = run(library.MoeFfn, x, lengths, norm, router, matrices, 2, True)
        status_int8, int8 = run(library.MoeFfnI8, x, lengths, norm, router, matrices, 2, True)
        assert status_float == status_int8 == 0
        assert floats.tobytes() == int8.tobytes()


@pytest.mark.parametrize("case", INT8_CASES)
def test_int8_row_is_bit_identical_alone_and_in_every_batch(library, kernel_target, case):
    """Batch invariance (issue 58) through the experts: one row's output is the same bits alone and
    in calls of 2 to 24 rows at every position and of 64 rows (its experts then get 1 to ~20 rows:
    int8_products.h straight from the blocks up to 4, from the unpacked tile above), whatever the
    other rows hold, so a request's tokens do not depend on what else its step runs."""
    if not has_int8_products(kernel_target):
        pytest.skip("the portable target has no int8 products")
    rng = np.random.default_rng(7)
    matrices = block_experts(rng, case)
    d = INT8_CASES[case][1][0]
    router = rng.standard_normal((E, d)).astype(np.float32)
    norm = np.ones(d, np.float32)
    probe = rng.standard_normal((1, d)).astype(np.float32)
    status, alone = run(library.MoeFfnI8, probe, np.ones(1, np.int32), norm, router, matrices, 2, True)
    assert status == 0
    for rows in [*range(2, 25), 64]:
        others = (rng.standard_normal((rows, d)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
        for at in range(rows) if rows <= 24 else (0, 31, 63):
            x = others.copy()
            x[at] = probe[0]
            status, out = run(library.MoeFfnI8, x, np.ones(rows, np.int32), norm, router, matrices, 2, True)
            assert status == 0
            assert out[at].tobytes() == alone[0].tobytes(), (case, rows, at)


def test_int8_shared_expert_rows_are_batch_invariant(library, kernel_target):
    """MoeFfnI8 with a Q8_0 shared expert: near the float reference (its inputs rounded per block of
    32), and a row's output the same bits alone and among other rows."""
    if not has_int8_products(kernel_target):
        pytest.skip("the portable target has no int8 products")
    rng = np.random.default_rng(13)
    matrices, extra = experts(rng, Q8_0), shared_expert(rng, Q8_0)
    router = rng.standard_normal((E, D)).astype(np.float32)
    norm = np.ones(D, np.float32)
    x = rng.standard_normal((9, D)).astype(np.float32)
    status, out = run(library.MoeFfnI8, x, np.ones(9, np.int32), norm, router, matrices, 2, True, extra)
    assert status == 0
    expected = reference(x, norm, router, matrices, 2, True, 9, shared=extra)
    scale = np.abs(expected - x).max()
    assert 0 < np.abs(out - expected).max() < 2e-2 * scale
    status, alone = run(
        library.MoeFfnI8, x[4:5], np.ones(1, np.int32), norm, router, matrices, 2, True, extra
    )
    assert status == 0 and alone[0].tobytes() == out[4].tobytes()
