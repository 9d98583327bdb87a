"""runtime.activations auto (agent/activations.py): int8 only where the fused CPU kernel multiplies
integer-format layer matrices with integer dot products; float32, saying why, everywhere else; a set
value is kept."""

import pytest

from agent.activations import auto_activations, resolve_activations
from agent.kernels import has_int8_products
from agent.kernels import target as kernel_target
from agent.model.formats import load_checkpoint
from agent.model.shard import WHOLE_MODEL, TensorSplit
from config.schema import RuntimeSection
from tiny_models import write_tiny_checkpoint, write_tiny_gguf

RUNTIME = RuntimeSection(num_slots=2, max_seq_len=64, prefill_buckets=[64], decode_batch_buckets=[1, 2])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("auto-activations")
    hf = write_tiny_checkpoint(directory / "hf", "llama")
    return {
        qtype: load_checkpoint(write_tiny_gguf(hf, directory / f"tiny.{qtype}.gguf", qtype))
        for qtype in ("Q8_0", "F32")
    }


def test_a_quantized_gguf_runs_int8_where_the_kernels_have_integer_dot_products(checkpoints):
    chosen, why = auto_activations(checkpoints["Q8_0"], RUNTIME, WHOLE_MODEL)
    if has_int8_products():
        assert (chosen, why) == (
            "int8",
            "Q8_0 layer matrices on kernels with integer dot products "
            f"(MS_LLM_KERNEL_TARGET={kernel_target()})",
        )
    else:
        assert chosen == "float32" and "no integer dot products" in why


@pytest.mark.parametrize(
    "qtype, runtime, split, why",
    [
        ("F32", RUNTIME, WHOLE_MODEL, "the layer matrices are float"),
        ("Q8_0", RUNTIME, TensorSplit(0, 2), "tensor-parallel ranks"),
        ("Q8_0", RUNTIME.model_copy(update={"matmul": "mindspore"}), WHOLE_MODEL, "MindSpore's ops"),
    ],
)
def test_everything_else_stays_float32_and_says_why(checkpoints, qtype, runtime, split, why):
    chosen, said = auto_activations(checkpoints[qtype], runtime, split)
    assert chosen == "float32" and why in said


def test_resolving_says_the_choice_and_keeps_a_set_value(checkpoints):
    said: list[str] = []
    resolved = resolve_activations(checkpoints["F32"], RUNTIME, WHOLE_MODEL, said.append)
    assert RUNTIME.activations == "auto" and resolved.activations == "float32"
    assert said == [
        "activations: float32 (exact), chosen by auto: the layer matrices are float: int8 activations "
        "would gain nothing; set runtime.activations to choose"
    ]
    exact = RUNTIME.model_copy(update={"activations": "float32"})
    assert resolve_activations(checkpoints["Q8_0"], exact, WHOLE_MODEL, said.append) is exact
    assert len(said) == 1
