"""The CPU kernels built for AArch64 and run under qemu-aarch64 on this x86 machine (tests/support/
arm_kernels.py), at three Arm targets: plain NEON (-march=armv8-a: int8 products by SMULL + SADALP),
the dot-product extension (armv8.2-a+dotprod: SDOT) and i8mm (armv8.6-a+i8mm+dotprod: SMMLA for the
unpacked tile's pairs of rows, SDOT straight from the blocks). Each runs the reference cases of the x86
kernel tests, with their references and tolerances (their helpers, and their tests where they are
cheap): every weight format's float32 and int8 products at row counts that take each path (a row at a
time, straight from the blocks, tiles dequantized or unpacked whole), a row's int8 result alike in
calls of other sizes, embedding rows, decode attention over float32 and q8_0 caches, prompt-attention
runs against their rows one by one, the fused layer's q8_0 cache writes, and the MoE op in float32 and
int8. Emulated: nothing here says how fast the Arm code runs. Skipped, saying why, where the cross
compiler or qemu is missing (`make arm-tools` installs them)."""

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import test_decode_attention as decode_attention
import test_kv_cache_q8 as kv_cache_q8
import test_moe_kernel as moe_kernel
import test_prompt_attention as prompt_attention
import test_weight_formats as weight_formats

from agent.kernels import KERNEL_MACROS
from agent.model.quantized import F32, block_shape
from arm_kernels import (
    TARGETS,
    ArmKernels,
    ArmTarget,
    build,
    defined_macros,
    instruction_counts,
    missing_tools,
)
from kernel_calls import call, packed
from reference_numpy import q8_1

FORMATS = weight_formats.FORMATS
INTEGER_FORMATS = weight_formats.INTEGER_FORMATS
# Row counts that take every path of the float32 products (packed_matmul.h: a row at a time up to a
# format's ROW_BY_ROW, straight from the blocks in blocks of up to 8 to 32 rows, dequantized tiles
# above) and of the int8 ones (int8_products.h: straight from the blocks up to 4 rows in blocks of 2,
# unpacked tiles above in blocks of up to 6, odd blocks among them: i8mm pairs their last row).
FLOAT_ROWS = (1, 2, 3, 5, 8, 9, 17, 32, 33, 64)
INT8_ROWS = (1, 2, 3, 4, 5, 6, 7, 11, 13, 64)


@pytest.fixture(scope="module", params=TARGETS, ids=lambda target: target.name)
def target(request: pytest.FixtureRequest) -> ArmTarget:
    why = missing_tools()
    if why:
        pytest.skip(why)
    return request.param


@pytest.fixture(scope="module")
def arm(target: ArmTarget) -> Iterator[ArmKernels]:
    kernels = ArmKernels(build(target))
    yield kernels
    kernels.close()


def test_each_target_compiles_its_own_int8_products(target, arm):
    """The compiler defines the target's macros (each one of KERNEL_MACROS, so that the x86 host's
    builds are keyed by them too), and its machine code holds the target's products and not the
    others': SDOT only with the dot-product extension, SMMLA only with i8mm, SADALP's plain-NEON
    sums only without either."""
    assert target.macros <= set(KERNEL_MACROS)
    macros = defined_macros(target)
    assert target.macros <= macros
    assert not ({"__ARM_FEATURE_DOTPROD", "__ARM_FEATURE_MATMUL_INT8"} - target.macros) & macros
    counts = instruction_counts(arm.program, target.instructions | target.absent)
    assert all(counts[name] > 0 for name in target.instructions), counts
    assert not any(counts[name] for name in target.absent), counts


def test_float32_weight_products_match_numpy(arm):
    """SkinnyMatMul and SkinnyMatMulAdd (test_packed_matmul's check) at k 40 and 96."""
    for k_dim in (40, 96):
        rng = np.random.default_rng(k_dim)
        n_dim = 3 * 32
        w = rng.standard_normal((k_dim, n_dim)).astype(np.float32)
        for rows in (1, 2, 3, 4, 5, 8, 13, 29):
            x = rng.standard_normal((rows, k_dim)).astype(np.float32)
            residual = rng.standard_normal((rows, n_dim)).astype(np.float32)
            expected = x.astype(np.float64) @ w.astype(np.float64)
            out = np.full((rows, n_dim), np.nan, np.float32)
            assert call(arm.SkinnyMatMul, [x, packed(w)], out) == 0
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")
            out = np.full((rows, n_dim), np.nan, np.float32)
            assert call(arm.SkinnyMatMulAdd, [x, packed(w), residual], out) == 0
            np.testing.assert_allclose(out, expected + residual, rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")


def _matrix(qtype):
    cols = 2 * block_shape(qtype)[0] if block_shape(qtype)[0] > 32 else 96
    return weight_formats.random_matrix(qtype, 70, cols, seed=qtype.value)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_every_format_matches_the_dequantized_product(arm, qtype):
    """test_weight_formats' check at the row counts of each path."""
    w, matrix = _matrix(qtype)
    rng = np.random.default_rng(1)
    for rows in FLOAT_ROWS:
        x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        got = weight_formats.product(arm, x, matrix)
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{qtype.name}, {rows} rows"
        )


def _int8_product(arm, x: np.ndarray, matrix) -> np.ndarray:
    out = np.full((len(x), matrix.packed.shape[0] * 32), np.nan, np.float32)
    format_id = np.array([matrix.qtype.value], np.int32)
    assert call(arm.SkinnyMatMulFormatI8, [x, matrix.packed, format_id], out) == 0
    return out


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_int8_activations_match_the_q8_1_product(arm, qtype):
    """SkinnyMatMulFormatI8 (test_weight_formats' check): every integer format's product with
    Q8_1-rounded activations is the fp64 product of the rounded activations (exact integer sums);
    F16 and BF16 stay float32 products."""
    w, matrix = _matrix(qtype)
    floats = qtype in weight_formats.FLOAT_FORMATS
    rng = np.random.default_rng(2)
    for rows in INT8_ROWS:
        x = (rng.standard_normal((rows, w.shape[1])) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        want = (x.astype(np.float64) if floats else q8_1(x)) @ w.T
        got = _int8_product(arm, x, matrix)[:, :70]
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{qtype.name}, {rows} rows"
        )


@pytest.mark.parametrize("qtype", INTEGER_FORMATS, ids=lambda t: t.name)
def test_an_int8_row_computes_alike_in_calls_of_other_sizes(arm, qtype):
    """Batch invariance (test_weight_formats' check, at fewer row counts and positions): a row's
    output is bit-identical alone (straight from the blocks) and first, in the middle and last of
    calls straight from the blocks and from unpacked tiles (SMMLA's pairs, an odd block's last row
    paired with itself)."""
    _, matrix = _matrix(qtype)
    cols = matrix.shape[1]
    rng = np.random.default_rng(3)
    probe = rng.standard_normal((1, cols)).astype(np.float32)
    alone = _int8_product(arm, probe, matrix)
    for rows in (2, 4, 5, 6, 7, 13, 64):
        others = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
        for at in sorted({0, rows // 2, rows - 1}):
            x = others.copy()
            x[at] = probe[0]
            out = _int8_product(arm, x, matrix)
            assert out[at].tobytes() == alone[0].tobytes(), (qtype.name, rows, at)


def test_matrix_rows_are_the_dequantized_rows(arm):
    weight_formats.test_matrix_rows_are_the_dequantized_rows(arm)
    weight_formats.test_a_shape_that_does_not_fit_the_format_is_refused(arm)


@pytest.mark.parametrize(
    "groups, hd, block, kv",
    [(3, 64, 16, 3), (5, 12, 4, 2), (1, 8, 1, 1), (9, 128, 32, 1), (2, 20, 8, 2)],
    ids=str,
)
def test_decode_attention_matches_numpy(arm, groups, hd, block, kv):
    decode_attention.test_attention_over_shuffled_blocks_matches_numpy(arm, groups, hd, block, kv)


def test_decode_attention_refuses_a_table_outside_the_cache(arm):
    decode_attention.test_a_table_reaching_outside_the_cache_is_refused(arm)


@pytest.mark.parametrize("groups, hd, block, kv", [(3, 64, 16, 3), (1, 96, 1, 2)], ids=str)
def test_decode_attention_over_a_q8_0_cache_matches_numpy(arm, groups, hd, block, kv):
    kv_cache_q8.test_decode_attention_over_a_q8_0_cache_matches_numpy(arm, groups, hd, block, kv)
    kv_cache_q8.test_decode_attention_refuses_a_cache_of_neither_width(arm)


def test_the_fused_layer_writes_q8_0_rows_as_gguf(arm):
    kv_cache_q8.test_the_fused_layer_writes_each_new_row_as_gguf_q8_0_bytes(arm)
    kv_cache_q8.test_q8_0_rows_of_edge_values_match_gguf(arm)


def test_prompt_attention_runs_attend_as_their_rows_one_by_one(arm):
    prompt_attention.test_a_run_sizes_its_scratch_from_its_longest_kv_head(arm)
    prompt_attention.test_a_run_in_a_sliding_window_attends_as_its_rows_one_by_one(arm, 5)
    for split, window in (([3, 5], 0), ([1, 6, 1], 6)):
        prompt_attention.test_a_row_attends_alike_in_blocks_of_every_size(arm, split, window)


@pytest.mark.parametrize("qtype", [F32, gguf.GGMLQuantizationType.Q8_0], ids=["F32", "Q8_0"])
def test_moe_rows_get_their_chosen_experts_weighted_sum(arm, qtype):
    moe_kernel.test_rows_get_their_chosen_experts_weighted_sum(arm.MoeFfn, qtype, 2, True)


@pytest.mark.parametrize("case", moe_kernel.INT8_CASES)
def test_int8_moe_matches_the_block_rounded_reference(arm, case):
    """test_moe_kernel's check of MoeFfnI8: against the numpy MoE whose experts' inputs are rounded
    per block of 32 (tie-free rows to float32's reach, rows meeting a near tie within a few roundings'
    move) and far from the float reference; then a row alone and in a call of 24 rows, bit for bit."""
    rng = np.random.default_rng(5)
    matrices = moe_kernel.block_experts(rng, case)
    d = moe_kernel.INT8_CASES[case][1][0]
    router = rng.standard_normal((moe_kernel.E, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    x = moe_kernel.int8_rows_match_the_reference(arm.MoeFfnI8, rng, d, norm, router, matrices)
    probe = x[:1].copy()
    status, alone = moe_kernel.run(arm.MoeFfnI8, probe, np.ones(1, np.int32), norm, router, matrices, 2, True)
    assert status == 0
    others = rng.standard_normal((24, d)).astype(np.float32)
    for at in (0, 23):
        batch = others.copy()
        batch[at] = probe[0]
        status, out = moe_kernel.run(
            arm.MoeFfnI8, batch, np.ones(24, np.int32), norm, router, matrices, 2, True
        )
        assert status == 0 and out[at].tobytes() == alone[0].tobytes(), (case, at)
