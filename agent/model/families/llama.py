"""Llama 2 and 3, Mistral, SmolLM2: the layout the other families start from (llama.cpp's and
Hugging Face's names for a pre-norm decoder with grouped-query attention and SwiGLU)."""

from __future__ import annotations

from agent.model.families.base import Family, GgufLayout, HfLayout

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
GGUF_BIAS_NAMES = {"attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}

HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    # a config.json's attention_bias: true (Llama's are off by default)
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
}
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}

FAMILY = Family(
    "llama",
    gguf=GgufLayout("llama", GGUF_LAYER_NAMES, GGUF_GLOBAL_NAMES, permuted_qk=True),
    hf=HfLayout("llama", HF_LAYER_NAMES, HF_GLOBAL_NAMES),
)
