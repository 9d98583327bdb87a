"""python -m tools.memory_plan: a model's plan on a given card from its config.json alone (Qwen3-8B's
published sizes: no weights here), with every reserve and the headroom, and a clear refusal for a
card that cannot hold the weights."""

import json
from pathlib import Path

import pytest

from config.schema import PROJECT_ROOT
from tools.memory_plan import main

ASCEND_CONFIG = PROJECT_ROOT / "config" / "llama2_7b_ascend.yaml"


def write_qwen3_8b(directory: Path) -> Path:
    """Qwen3-8B's config.json: hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, FFN 12288,
    vocabulary 151936, an output head of its own."""
    model = directory / "Qwen3-8B"
    model.mkdir()
    config = {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def plan_output(model: Path, card_mb: int, capsys) -> tuple[int, str, str]:
    args = ["--config", str(ASCEND_CONFIG), "--card-mb", str(card_mb), "--model", str(model)]
    code = main([*args, "--dtype", "bfloat16"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("card_mb", "budget_mb", "blocks"), [(65536, 58000, 17670), (32768, 25232, 3398)])
def test_qwen3_8b_bfloat16_plans_into_a_card_with_every_reserve(tmp_path, capsys, card_mb, budget_mb, blocks):
    """The budget is the card less what the config leaves outside its own (65536 - 58000 MB); the KV
    pool takes what the 8.2B bfloat16 weights (15623 MB), working memory and reserves leave."""
    code, out, err = plan_output(write_qwen3_8b(tmp_path), card_mb, capsys)
    assert code == 0, err
    assert f"Qwen3-8B (bfloat16) on a {card_mb} MB Ascend card, memory_budget_mb {budget_mb}:" in out
    assert "weights 15623 MB, KV cache" in out and f": {blocks} blocks of 16 positions" in out
    for line in ("working", "kernel workspace", "graph inputs/outputs"):
        assert f"\n  {line}: " in out
    assert "logits [512, 151936] float32" in out  # a 512-row prefill's every row: 297 MB
    headroom = out.splitlines()[-1]  # what lies outside the budget, and its few MB under a block
    assert headroom.startswith("headroom: ") and f"({card_mb - budget_mb} MB outside the budget, " in headroom


def test_a_card_that_cannot_hold_the_weights_is_refused(tmp_path, capsys):
    code, out, err = plan_output(write_qwen3_8b(tmp_path), 16384, capsys)
    assert code == 1 and out == ""
    assert err.startswith(
        "refused: Qwen3-8B does not fit a 16384 MB card: its weights in bfloat16 take 15623 MB"
    )
    assert "the card's budget is 8848 MB" in err


def test_a_model_path_without_a_spec_is_refused(tmp_path, capsys):
    code, _, err = plan_output(tmp_path / "absent", 65536, capsys)
    assert code == 1 and "does not exist: give --model a HuggingFace directory with config.json" in err


def test_a_rank_of_a_tensor_parallel_group_plans_its_share_and_hccl_buffers(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)  # CANN's default
    model = write_qwen3_8b(tmp_path)
    args = ["--config", str(ASCEND_CONFIG), "--card-mb", "65536", "--model", str(model)]
    assert main([*args, "--dtype", "bfloat16", "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3-8B (bfloat16, one rank of 2) on a 65536 MB Ascend card" in out
    assert "weights 8999 MB" in out  # half the layers' matrices, the embedding and output head whole
    assert "\n  HCCL buffers: 400 MB (1 communicator x 2 x HCCL_BUFFSIZE 200 MB" in out
