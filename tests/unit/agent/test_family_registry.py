"""The model families (agent/model/families/): the registry finds each by the name its files give and
refuses another naming the supported ones; each family's module declares, without MindSpore, the
weight names of every format it is read from, covering every tensor its layers read."""

from importlib import import_module
from pathlib import Path

import numpy as np
import pytest

from agent.model import families
from agent.model.checkpoint import CheckpointError, expected_shapes
from agent.model.families.base import GgufLayout, HfLayout, packed_parts
from agent.model.spec import ModelSpec
from agent.model.tokenizer import TEMPLATES

GGUF_ARCHITECTURES = {
    name: name
    for name in ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma3", "smollm3", "qwen35", "qwen35moe")
}
HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "internlm2": "internlm2",
    "mistral": "mistral",
    "smollm3": "smollm3",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
}
GLOBAL_TENSORS = {"embed", "final_norm", "lm_head"}


def tiny_spec(architecture: str, qkv_bias: bool, **fields) -> ModelSpec:
    return ModelSpec(
        architecture=architecture,
        name="tiny",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=16,
        rope_theta=10000.0,
        rms_eps=1e-6,
        tied_embeddings=False,
        qkv_bias=qkv_bias,
        max_context=64,
        bos_id=None,
        eos_ids=(0,),
        **fields,
    )


@pytest.mark.parametrize(("architecture", "family"), GGUF_ARCHITECTURES.items())
def test_each_gguf_architecture_resolves_to_its_family(architecture, family):
    layout = families.gguf_layout(architecture, Path("m.gguf"))
    assert layout is import_module(f"agent.model.families.{family}").FAMILY.gguf
    assert layout.architecture == architecture


# the multimodal checkpoints whose language model a family reads
HF_LANGUAGE_MODELS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


@pytest.mark.parametrize(("model_type", "family"), HF_MODEL_TYPES.items())
def test_each_hf_model_type_resolves_to_its_family(model_type, family):
    layout = families.hf_layout(model_type, Path("m"))
    assert layout is import_module(f"agent.model.families.{family}").FAMILY.hf
    assert layout.model_type == model_type


@pytest.mark.parametrize(("model_type", "family"), HF_LANGUAGE_MODELS.items())
def test_a_multimodal_checkpoint_resolves_to_its_language_models_family(model_type, family):
    """Qwen3.5's published checkpoints: the language model's tensors under model.language_model.,
    the LM head where it is, the vision tower and MTP layers not read."""
    text = import_module(f"agent.model.families.{family}").FAMILY.hf
    layout = families.hf_layout(model_type, Path("m"))
    assert layout.language_model_only and layout.model_type == model_type
    assert layout.layer_names is text.layer_names and layout.spec_fields is text.spec_fields
    names = {
        "model.language_model.layers.3.self_attn.q_proj.weight": "layers.3.wq",
        "model.language_model.embed_tokens.weight": "embed",
        "model.language_model.norm.weight": "final_norm",
        "lm_head.weight": "lm_head",
        "model.layers.3.self_attn.q_proj.weight": None,
        "model.visual.blocks.0.attn.qkv.weight": None,
        "mtp.layers.0.self_attn.q_proj.weight": None,
    }
    assert {name: layout.canonical_name(name) for name in names} == names


@pytest.mark.parametrize("name", ["deepseek2", "mamba", None, 3])
def test_an_unknown_architecture_is_refused_naming_the_supported_ones(name):
    with pytest.raises(CheckpointError) as gguf_refusal:
        families.gguf_layout(name, Path("m.gguf"))
    assert (
        str(gguf_refusal.value) == f"m.gguf: unsupported architecture {name!r} "
        "(supported: llama, qwen2, qwen3, qwen3moe, phi3, gemma3, gemma-embedding, smollm3, qwen35, "
        "qwen35moe)"
    )
    with pytest.raises(CheckpointError) as hf_refusal:
        families.hf_layout(name, Path("m"))
    assert (
        str(hf_refusal.value) == f"m: unsupported architecture {name!r} "
        "(supported: llama, qwen2, qwen3, qwen3_moe, phi3, gemma3_text, internlm2, mistral, smollm3, "
        "qwen3_5_text, "
        "qwen3_5_moe_text, qwen3_5, qwen3_5_moe)"
    )


def test_every_family_module_is_registered_under_its_name():
    modules = sorted(
        p.stem for p in Path(families.__file__).parent.glob("*.py") if p.stem not in {"__init__", "base"}
    )
    assert sorted(families.MODULES) == modules
    for name in families.MODULES:
        family = import_module(f"agent.model.families.{name}").FAMILY
        assert family.name == name and (family.gguf or family.hf) is not None


def layer_tensors(spec: ModelSpec) -> set[str]:
    """What the shared layers read of layer 1 (agent/model/checkpoint.py expected_shapes: a
    Gated DeltaNet layer's in place of the attention's), each expert's left out (a MoE layout names
    their stacked tensors: test_qwen3moe_names_its_router_and_every_experts_matrices)."""
    return {
        name for name, _ in expected_shapes(spec) if name.startswith("layers.1.") and ".experts." not in name
    }


# What a MoE family requires of its files (Qwen3-MoE's), and a hybrid one (Qwen3.5's Gated DeltaNet
# layers); the dense families read none of it
METADATA = {
    **{"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 16},
    **{"ssm.conv_kernel": 4, "ssm.state_size": 8, "ssm.group_count": 2, "ssm.time_step_rank": 4},
    "ssm.inner_size": 32,
}
CONFIG = {
    **{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    **{"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8},
    "linear_value_head_dim": 8,
}


def no_metadata(key, default=None, required=True):
    return METADATA.get(key, default)


@pytest.mark.parametrize("layout", families.GGUF.values(), ids=families.GGUF.keys())
def test_each_gguf_layout_maps_every_tensor_its_layers_read(layout: GgufLayout):
    fields = layout.spec_fields(Path("m.gguf"), no_metadata, 32, 8, 2) if layout.spec_fields else {}
    spec = tiny_spec(layout.architecture, qkv_bias=layout.qkv_bias, **fields)
    canonical = {
        part
        for name in layout.layer_names
        for part, _ in packed_parts(layout.canonical_name(f"blk.1.{name}") or "", spec)
    }
    canonical |= {layout.canonical_name(name) for name in layout.global_names}
    assert canonical >= layer_tensors(spec) | GLOBAL_TENSORS
    assert layout.canonical_name("blk.1.no_such.weight") is None and layout.canonical_name("x") is None
    assert layout.chat_template is None or (TEMPLATES / layout.chat_template).is_file()


# each family's own layout (a multimodal checkpoint's reads the same names: the test above)
TEXT_LAYOUTS = {name: layout for name, layout in families.HF.items() if not layout.language_model_only}


@pytest.mark.parametrize("layout", TEXT_LAYOUTS.values(), ids=TEXT_LAYOUTS.keys())
def test_each_hf_layout_maps_every_tensor_its_layers_read(layout: HfLayout):
    config = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, **CONFIG}
    fields = layout.spec_fields(config) if layout.spec_fields else {}
    biases = any(name.endswith(".bias") for name in layout.layer_names)  # Phi-3 has none
    spec = tiny_spec(layout.model_type, qkv_bias=biases, **fields)
    # every tensor the layout names, bias included, as it lies in the files: packed Q/K/V rows are
    # (kv heads x (group + 2) x head size), the size a family's transform splits; a packed gate and
    # up (Phi-3's) twice the FFN's
    rows = spec.num_kv_heads * (spec.group_size + 2) * spec.head_dim
    shapes = dict(expected_shapes(spec))  # a Gated DeltaNet layer's tensors, which its transform reorders
    tensors = {
        name: np.zeros(
            shapes[name]
            if ".delta_" in name
            else (2 * spec.intermediate_size if name.endswith("w_gate_up") else rows, 4)
        )
        for name in (layout.canonical_name(f"model.layers.1.{n}") for n in layout.layer_names)
    }
    tensors |= {layout.canonical_name(name): np.zeros(1) for name in layout.global_names}
    if layout.transform is not None:
        layout.transform(tensors, spec)
    assert set(tensors) >= layer_tensors(spec) | GLOBAL_TENSORS


def test_qwen3moe_names_its_router_and_every_experts_matrices():
    """GGUF: the 3-D expert tensors (split per expert by the reader); HF: one tensor per expert,
    any number of them; transformers' mlp_only_layers and decoder_sparse_step make dense layers."""
    gguf, hf = families.GGUF["qwen3moe"], families.HF["qwen3_moe"]
    assert gguf.canonical_name("blk.3.ffn_gate_inp.weight") == "layers.3.router"
    assert gguf.canonical_name("blk.3.ffn_down_exps.weight") == "layers.3.experts.w_down"
    assert hf.canonical_name("model.layers.3.mlp.gate.weight") == "layers.3.router"
    assert hf.canonical_name("model.layers.3.mlp.experts.127.up_proj.weight") == "layers.3.experts.127.w_up"
    assert hf.canonical_name("model.layers.3.mlp.experts.x.up_proj.weight") is None
    assert hf.spec_fields is not None
    config = {"num_hidden_layers": 6, **CONFIG, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert hf.spec_fields(config)["dense_layers"] == (0, 2, 3, 4)


def test_qwen35moe_names_its_shared_expert_and_always_renormalises():
    """Qwen3.5-MoE: Qwen3.5's hybrid layers, Qwen3-MoE's experts, and the shared expert with its
    sigmoid gate, in both formats; the routed weights renormalised whatever a file says (transformers'
    router and llama.cpp's graph both do)."""
    gguf, hf = families.GGUF["qwen35moe"], families.HF["qwen3_5_moe_text"]
    assert gguf.canonical_name("blk.2.ffn_gate_inp_shexp.weight") == "layers.2.shared_expert_gate"
    assert gguf.canonical_name("blk.2.ffn_down_shexp.weight") == "layers.2.shared_expert.w_down"
    assert gguf.canonical_name("blk.2.ssm_out.weight") == "layers.2.delta_out"
    assert (
        hf.canonical_name("model.layers.2.mlp.shared_expert.up_proj.weight") == "layers.2.shared_expert.w_up"
    )
    assert (
        hf.canonical_name("model.layers.2.mlp.experts.255.gate_proj.weight") == "layers.2.experts.255.w_gate"
    )
    assert gguf.spec_fields is not None and hf.spec_fields is not None
    meta = {**METADATA, "expert_weights_norm": False, "expert_shared_feed_forward_length": 16}
    fields = gguf.spec_fields(
        Path("m.gguf"), lambda key, default=None, required=True: meta.get(key, default), 32, 8, 4
    )
    assert fields["norm_topk_prob"] and fields["shared_expert_intermediate_size"] == 16
    assert fields["linear_attention"].layers == (0, 1, 2)
    config = {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, **CONFIG}
    assert hf.spec_fields(config)["shared_expert_intermediate_size"] == 16  # the experts' where unsaid
