"""Llama-, Qwen3-, Qwen3.5-, Qwen3.5-MoE-, Phi-3-, SmolLM3- or Gemma-3-architecture GGUF files of a
chosen shape and weight format, with random weights and the default model's tokenizer (or another GGUF's, cut
to its first tokens): for benchmarks and tests of how cost grows with a model's size, and tiny
models of each architecture for the tests.

    python -m tools.make_gguf --shape 1b --format Q4_K_M --out models/random-1b-Q4_K_M.gguf
    python -m tools.make_gguf --shape 1b --arch qwen3 --format Q4_K_M --out models/random-qwen3-1b.gguf
    python -m tools.make_gguf --hidden 512 --layers 4 --ffn 1536 --heads 8 --kv-heads 2 \
        --format Q8_0 --out x.gguf
    python -m tools.make_gguf --shape gemma3-270m --format gemma --tokenizer models/gemma-3-270m-q4_k_m.gguf \
        --out models/random-gemma3-270m.gguf

Gemma 3 (`--shape gemma3-270m`, or `arch="gemma3"`): its four norms a layer and QK-norm (weights
near 1, as a GGUF holds Gemma's 1 + w), the head size of its own, the sliding window and the file's
RoPE base; format `gemma`: the real 270M file's mix (Q5_0 Q, K, gate and up, Q8_0 V and embedding,
Q4_K output, Q6_K down). EmbeddingGemma (`--shape embeddinggemma-300m`, `arch="gemma-embedding"`):
Gemma 3's layers as an encoder, mean pooling (pooling_type 1) and the two dense projections
(dense_2, dense_3), as llama.cpp's converter writes it with --sentence-transformers-dense-modules.

Qwen3 (`arch="qwen3"`): Llama's layers with QK-norm; Phi-3 (`arch="phi3"`): Q, K and V packed in
attn_qkv, gate and up in ffn_up, as llama.cpp writes them; SmolLM3 (`arch="smollm3"`, `--shape
smollm3-3b`): Llama's tensors, every fourth layer without RoPE (the architecture says so, no key).

Qwen3.5 (`arch="qwen35"`, `--shape qwen35-2b`): three Gated DeltaNet layers of every four (attn_qkv,
attn_gate, ssm_beta and ssm_alpha (F32), ssm_conv1d (F32), ssm_dt.bias, ssm_a (A < 0: decays of
about 0.9 a token), ssm_norm, ssm_out) and a gated attention layer (attn_q holding each head's gate,
QK-norm, RoPE on rope.dimension_count dims), every layer's FFN pre-norm named post_attention_norm,
as llama.cpp's converter writes them:

    python -m tools.make_gguf --shape qwen35-2b --format Q4_K_M --out models/random-qwen35-2b.gguf

Qwen3.5-MoE (`arch="qwen35moe"`, `--shape qwen35moe-a3b`): Qwen3.5's layers, each FFN Qwen3-MoE's
experts (below) and a shared expert (ffn_gate_inp_shexp, F32, and ffn_gate_shexp, ffn_up_shexp,
ffn_down_shexp):

    python -m tools.make_gguf --shape qwen35moe-a3b --format Q4_K_M --out models/random-qwen35moe-a3b.gguf

Qwen3-MoE (`arch="qwen3moe"`, `--shape qwen3-30b-a3b` or `moe-7b-a1b`): Qwen3's attention and, in
place of each layer's FFN, a router (ffn_gate_inp [experts, hidden], F32 as llama.cpp keeps it) and
the experts as 3-D tensors [experts, out, in] (ffn_gate_exps, ffn_up_exps, ffn_down_exps) in the
format's type (ffn_down_exps as ffn_down in the mixes):

    python -m tools.make_gguf --shape moe-7b-a1b --format Q4_K_M --out models/random-moe-7b-a1b.gguf

Formats: one type for every matrix (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16,
BF16, F32), or llama.cpp's mixes Q4_K_M and Q5_K_M (Q4_K / Q5_K, with Q6_K for the LM head (the
embedding when tied) and for attn_v and ffn_down in the layers llama.cpp gives more bits). A matrix
whose rows do not fit the type's blocks gets llama.cpp's fallback type. Quants are random and
scales small (weights of about 0.02): the loader and kernels take whatever blocks a file holds.
A Llama's output projections (attn_output, ffn_down) are scaled down by 1/sqrt(2 x layers), as
trained models are initialised: without it each layer adds as much as the whole residual stream
holds, and a deep random model turns chaotic (a rounding anywhere moves every logit, so int8
activations could not be measured on the 3B and 7B shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, PoolingType
from gguf.quants import dequantize

from agent.model.formats.gguf_header import GgufFile
from server.pooling import RERANK_TEMPLATE

T = GGMLQuantizationType
DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


# --arch: a dense preset's layers in one of these families' forms
DENSE_ARCHES = ("llama", "qwen3", "phi3", "smollm3")


GEMMA = ("gemma3", "gemma-embedding")  # the architectures of Gemma 3's layers


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    tied: bool = True
    arch: str = "llama"
    head_dim: int | None = None  # None: hidden / heads
    window: int = 0  # gemma3: the local layers' sliding window
    context: int = 8192
    rope_base: float = 100000.0
    experts: int = 0  # qwen3moe: experts a layer, of which experts_used a token, each expert_ffn wide
    experts_used: int = 0
    expert_ffn: int = 0
    # qwen35: the Gated DeltaNet layers' key and value heads (each linear_dim wide), conv, the
    # attention layers' rotated dims; layer i attends where (i + 1) % 4 == 0
    linear_heads: tuple[int, int] = (0, 0)
    linear_dim: int = 128
    conv_kernel: int = 4
    rotary: int = 0

    shared_ffn: int = 0  # qwen35moe: the shared expert's width (0: none)
    dense: int = 0  # gemma-embedding: the width between its two projections (0: none)
    # an embedding model's or reranker's llama.cpp pooling_type (3 last, 4 rank; 0: a generating
    # model), written as llama.cpp's converter writes Qwen3-Embedding and Qwen3-Reranker
    pooling: int = 0

    def is_linear(self, layer: int) -> bool:
        return self.arch in ("qwen35", "qwen35moe") and (layer + 1) % 4 != 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "135m": Shape(576, 30, 1536, 9, 3),  # SmolLM2-135M
    "0.5b": Shape(1024, 24, 4096, 16, 8),
    "1b": Shape(2048, 16, 8192, 32, 8),  # Llama 3.2 1B
    "3b": Shape(3072, 28, 8192, 24, 8),  # Llama 3.2 3B
    "7b": Shape(4096, 32, 11008, 32, 32, tied=False),  # Llama 2 7B
    "gemma3-270m": Shape(
        640, 18, 2048, 4, 1, arch="gemma3", head_dim=256, window=512, context=32768, rope_base=1e6
    ),
    # SmolLM3-3B: Llama's layers, every fourth without RoPE (NoPE: the loader knows, no key says)
    "smollm3-3b": Shape(2048, 36, 11008, 16, 4, arch="smollm3", head_dim=128, context=65536, rope_base=5e6),
    # Qwen3-Embedding-0.6B and Qwen3-Reranker-0.6B (with --tokenizer models/llama-vocab/ggml-vocab-qwen2.gguf)
    "embeddinggemma-300m": Shape(
        768,
        24,
        1152,
        3,
        1,
        arch="gemma-embedding",
        head_dim=256,
        window=512,
        context=2048,
        rope_base=1e6,
        pooling=1,
        dense=3072,
    ),
    "qwen3-embedding-0.6b": Shape(
        1024, 28, 3072, 16, 8, arch="qwen3", head_dim=128, context=32768, rope_base=1e6, pooling=3
    ),
    "qwen3-reranker-0.6b": Shape(
        1024, 28, 3072, 16, 8, arch="qwen3", head_dim=128, context=32768, rope_base=1e6, pooling=4
    ),
    "qwen3-8b": Shape(
        4096, 36, 12288, 32, 8, tied=False, arch="qwen3", head_dim=128, context=40960, rope_base=1e6
    ),
    "qwen3-32b": Shape(
        5120, 64, 25600, 64, 8, tied=False, arch="qwen3", head_dim=128, context=40960, rope_base=1e6
    ),
    # Qwen3-30B-A3B: 30.5B weights, 3.3B a token (8 of 128 experts of 768)
    "qwen3-30b-a3b": Shape(
        2048,
        48,
        6144,
        32,
        4,
        tied=False,
        arch="qwen3moe",
        head_dim=128,
        context=40960,
        rope_base=1e6,
        experts=128,
        experts_used=8,
        expert_ffn=768,
    ),
    # Qwen3.5-2B: 24 layers, 18 of them Gated DeltaNet (16 key and 16 value heads of 128), gated
    # attention of 8 heads of 256 (2 KV), RoPE on 64 of each head's dims
    "qwen35-2b": Shape(
        2048,
        24,
        6144,
        8,
        2,
        arch="qwen35",
        head_dim=256,
        context=262144,
        rope_base=1e7,
        linear_heads=(16, 16),
        rotary=64,
    ),
    # Qwen3.5-35B-A3B's layers (40: 30 Gated DeltaNet of 16 key and 32 value heads, 10 gated
    # attention of 16 heads of 256 over 2 KV), 8 routed experts of 512 and the shared one a token,
    # with 64 experts a layer instead of 256 so that it fits a 24 GB machine: ~9.6B weights, the
    # real model's ~3B a token
    "qwen35moe-a3b": Shape(
        2048,
        40,
        512,
        16,
        2,
        tied=False,
        arch="qwen35moe",
        head_dim=256,
        context=262144,
        rope_base=1e7,
        linear_heads=(16, 32),
        rotary=64,
        experts=64,
        experts_used=8,
        expert_ffn=512,
        shared_ffn=512,
    ),
    # ~6.7B weights, ~1.1B a token (8 of 64 experts of 1024) with the default tokenizer's vocabulary
    "moe-7b-a1b": Shape(
        2048,
        16,
        6144,
        16,
        4,
        tied=False,
        arch="qwen3moe",
        head_dim=128,
        rope_base=1e6,
        experts=64,
        experts_used=8,
        expert_ffn=1024,
    ),
}

# Each type's half-float fields (byte offsets in its block): its scale d, and the offset's factor m
# (Q4_1/Q5_1: the offset itself; K-quants: dmin) if any. TYPICAL: a weight's size in units of d
# (|quant| times sub-block scale); CENTRE: m in units of d that centres the weights on zero.
HALF_FIELDS: dict[GGMLQuantizationType, tuple[int, int | None]] = {
    T.Q4_0: (0, None),
    T.Q4_1: (0, 2),
    T.Q5_0: (0, None),
    T.Q5_1: (0, 2),
    T.Q8_0: (0, None),
    T.Q2_K: (80, 82),
    T.Q3_K: (108, None),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208, None),
    T.IQ4_NL: (0, None),  # a type without a CPU kernel (for the tests: it loads dequantized)
}
TYPICAL = {T.Q4_0: 4, T.Q4_1: 8, T.Q5_0: 8, T.Q5_1: 16, T.Q8_0: 64, T.Q2_K: 12, T.Q3_K: 40}
TYPICAL.update({T.Q4_K: 240, T.Q5_K: 480, T.Q6_K: 1000, T.IQ4_NL: 64})
CENTRE = {T.Q4_1: -7.5, T.Q5_1: -15.5, T.Q2_K: 1.5, T.Q4_K: 7.5, T.Q5_K: 15.5}
# the matrices that write into the residual stream (Gemma's post-norms rescale them anyway)
RESIDUAL_OUTPUTS = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
# llama.cpp keeps a router (and a shared expert's gate) in F32, as a Gated DeltaNet's conv and its b and a
KEPT_F32 = (
    "cls.output.weight",
    *("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"),
    *("ssm_conv1d.weight", "ssm_beta.weight", "ssm_alpha.weight"),
)
# llama.cpp's type for a matrix whose rows are no whole number of the K-quants' 256-weight blocks
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def random_blocks(
    qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.02
):
    """A [rows, cols] matrix of `qtype` as GGUF tensor data [rows, row bytes] (uint8), weights of
    about `scale`: random quants, half-float scales spread over a decade and a half (the K-quants'
    reach half denormals, which the kernels must read exactly) and offsets that roughly centre them."""
    if qtype in (T.F32, T.F16, T.BF16):
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == T.F32:
            return values
        if qtype == T.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d_at, m_at = HALF_FIELDS[qtype]
    d = scale / TYPICAL[qtype] * 10 ** rng.uniform(-1, 0.5, blocks.shape[:2])
    blocks[..., d_at : d_at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    if m_at is not None:
        m = CENTRE[qtype] * d * rng.uniform(0.5, 1.5, d.shape)
        blocks[..., m_at : m_at + 2] = m.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


GEMMA_MIX = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_K,
    "ffn_gate": T.Q5_0,
    "ffn_up": T.Q5_0,
    "ffn_down": T.Q6_K,
}


def mix(name: str) -> Callable[[str, int], GGMLQuantizationType]:
    """The type of each tensor (by GGUF name and layer count) for a format name."""
    if name == "gemma":  # the formats of the Gemma 3 270M Q4_K_M file
        return lambda tensor, layers: (
            T.Q8_0 if tensor.startswith("token_embd") else GEMMA_MIX[tensor.split(".")[2]]
        )
    if name in ("Q4_K_M", "Q5_K_M"):
        base = GGMLQuantizationType[name[:4]]

        def mixed(tensor: str, layers: int) -> GGMLQuantizationType:
            if tensor in ("output.weight", "token_embd.weight (tied)"):
                return T.Q6_K
            if tensor.endswith(
                ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
            ):
                i = int(tensor.split(".")[1])
                more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
                return T.Q6_K if more_bits else base
            return base

        return mixed
    single = GGMLQuantizationType[name]
    return lambda tensor, layers: single


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF names and [rows, cols] (or [n] for norms) of a model of this shape."""
    hd = shape.hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (-1, shape.hidden))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        if shape.arch in (*GEMMA, "qwen3", "qwen3moe"):
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        if shape.arch in GEMMA:
            out += [
                (b + "post_attention_norm.weight", (shape.hidden,)),
                (b + "post_ffw_norm.weight", (shape.hidden,)),
            ]
        if shape.arch == "phi3":  # Q, K, V packed in one matrix, gate and up in another
            out += [
                (b + "attn_norm.weight", (shape.hidden,)),
                (b + "attn_qkv.weight", ((shape.heads + 2 * shape.kv_heads) * hd, shape.hidden)),
                (b + "attn_output.weight", (shape.hidden, shape.heads * hd)),
                (b + "ffn_norm.weight", (shape.hidden,)),
                (b + "ffn_up.weight", (2 * shape.ffn, shape.hidden)),
                (b + "ffn_down.weight", (shape.hidden, shape.ffn)),
            ]
            continue
        if shape.arch in ("qwen35", "qwen35moe"):
            out += qwen35_layer(shape, i)
            continue
        if shape.arch == "qwen3moe":  # the experts in place of the FFN, 3-D [experts, out, in]
            e, fe = shape.experts, shape.expert_ffn
            out += [
                (b + "attn_norm.weight", (shape.hidden,)),
                (b + "attn_q.weight", (shape.heads * hd, shape.hidden)),
                (b + "attn_k.weight", (shape.kv_heads * hd, shape.hidden)),
                (b + "attn_v.weight", (shape.kv_heads * hd, shape.hidden)),
                (b + "attn_output.weight", (shape.hidden, shape.heads * hd)),
                (b + "ffn_norm.weight", (shape.hidden,)),
                (b + "ffn_gate_inp.weight", (e, shape.hidden)),
                (b + "ffn_gate_exps.weight", (e, fe, shape.hidden)),
                (b + "ffn_up_exps.weight", (e, fe, shape.hidden)),
                (b + "ffn_down_exps.weight", (e, shape.hidden, fe)),
            ]
            continue
        out += [
            (b + "attn_norm.weight", (shape.hidden,)),
            (b + "attn_q.weight", (shape.heads * hd, shape.hidden)),
            (b + "attn_k.weight", (shape.kv_heads * hd, shape.hidden)),
            (b + "attn_v.weight", (shape.kv_heads * hd, shape.hidden)),
            (b + "attn_output.weight", (shape.hidden, shape.heads * hd)),
            (b + "ffn_norm.weight", (shape.hidden,)),
            (b + "ffn_gate.weight", (shape.ffn, shape.hidden)),
            (b + "ffn_up.weight", (shape.ffn, shape.hidden)),
            (b + "ffn_down.weight", (shape.hidden, shape.ffn)),
        ]
    out.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        out.append(("output.weight", (-1, shape.hidden)))
    if shape.pooling == PoolingType.RANK:  # the LM head's rows of the labels, as the converter writes them
        out.append(("cls.output.weight", (2, shape.hidden)))
    if shape.dense:
        out += [
            ("dense_2.weight", (shape.dense, shape.hidden)),
            ("dense_3.weight", (shape.hidden, shape.dense)),
        ]
    return out


def qwen35_layer(shape: Shape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen3.5 layer's tensors: a Gated DeltaNet's or gated attention's, then the FFN."""
    b, d, hd = f"blk.{i}.", shape.hidden, shape.hd
    out: list[tuple[str, tuple[int, ...]]] = [(b + "attn_norm.weight", (d,))]
    if shape.is_linear(i):
        key_heads, value_heads = shape.linear_heads
        width = value_heads * shape.linear_dim
        channels = 2 * key_heads * shape.linear_dim + width
        out += [
            (b + "attn_qkv.weight", (channels, d)),
            (b + "attn_gate.weight", (width, d)),
            (b + "ssm_beta.weight", (value_heads, d)),
            (b + "ssm_alpha.weight", (value_heads, d)),
            (b + "ssm_conv1d.weight", (channels, shape.conv_kernel)),
            (b + "ssm_dt.bias", (value_heads,)),
            (b + "ssm_a", (value_heads,)),
            (b + "ssm_norm.weight", (shape.linear_dim,)),
            (b + "ssm_out.weight", (d, width)),
        ]
    else:
        out += [
            (b + "attn_q.weight", (2 * shape.heads * hd, d)),
            (b + "attn_k.weight", (shape.kv_heads * hd, d)),
            (b + "attn_v.weight", (shape.kv_heads * hd, d)),
            (b + "attn_output.weight", (d, shape.heads * hd)),
            (b + "attn_q_norm.weight", (hd,)),
            (b + "attn_k_norm.weight", (hd,)),
        ]
    out.append((b + "post_attention_norm.weight", (d,)))
    if shape.arch == "qwen35moe":  # the routed experts 3-D, and the shared one with its gate
        e, fe, fs = shape.experts, shape.expert_ffn, shape.shared_ffn
        return out + [
            (b + "ffn_gate_inp.weight", (e, d)),
            (b + "ffn_gate_exps.weight", (e, fe, d)),
            (b + "ffn_up_exps.weight", (e, fe, d)),
            (b + "ffn_down_exps.weight", (e, d, fe)),
            (b + "ffn_gate_inp_shexp.weight", (1, d)),
            (b + "ffn_gate_shexp.weight", (fs, d)),
            (b + "ffn_up_shexp.weight", (fs, d)),
            (b + "ffn_down_shexp.weight", (d, fs)),
        ]
    return out + [
        (b + "ffn_gate.weight", (shape.ffn, d)),
        (b + "ffn_up.weight", (shape.ffn, d)),
        (b + "ffn_down.weight", (d, shape.ffn)),
    ]


def fitting(qtype: GGMLQuantizationType, cols: int) -> GGMLQuantizationType:
    while qtype in GGML_QUANT_SIZES and cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, T.F16)
    return qtype


def cut_vocabulary(fields: dict, limit: int) -> dict:
    """A SentencePiece vocabulary's first `limit` tokens (Gemma's: its control and user-defined tokens,
    byte tokens and best pieces), then its one-character pieces for printable ASCII and the space
    (U+2581), so that small models still merge words: tokens, scores and token types cut alike."""
    tokens = fields["tokenizer.ggml.tokens"]
    chars = {chr(c) for c in range(33, 127)} | {"\u2581"}
    keep = list(range(min(limit, len(tokens))))
    keep += [i for i in range(limit, len(tokens)) if tokens[i] in chars]
    cut = dict(fields)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in fields:
            cut[key] = [fields[key][i] for i in keep]
    return cut


def add_shape(writer: GGUFWriter, shape: Shape, vocab: int) -> None:
    """The shape's hyperparameters as the GGUF keys of its arch."""
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.hd)
    writer.add_value_length(shape.hd)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch in GEMMA else 1e-5)
    writer.add_vocab_size(vocab)
    if shape.window:
        writer.add_sliding_window(shape.window)
    if shape.arch in ("qwen35", "qwen35moe"):
        key_heads, value_heads = shape.linear_heads
        arch = shape.arch
        writer.add_uint32(f"{arch}.ssm.conv_kernel", shape.conv_kernel)
        writer.add_uint32(f"{arch}.ssm.state_size", shape.linear_dim)
        writer.add_uint32(f"{arch}.ssm.group_count", key_heads)
        writer.add_uint32(f"{arch}.ssm.time_step_rank", value_heads)
        writer.add_uint32(f"{arch}.ssm.inner_size", value_heads * shape.linear_dim)
        writer.add_uint32(f"{arch}.full_attention_interval", 4)
        writer.add_uint32(f"{arch}.rope.dimension_count", shape.rotary)
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.shared_ffn:
        writer.add_expert_shared_feed_forward_length(shape.shared_ffn)
    if shape.pooling:
        writer.add_pooling_type(PoolingType(shape.pooling))
    if shape.dense:
        for name, (rows, cols) in (
            ("dense_2", (shape.dense, shape.hidden)),
            ("dense_3", (shape.hidden, shape.dense)),
        ):
            writer.add_uint32(f"{shape.arch}.{name}_feat_in", cols)
            writer.add_uint32(f"{shape.arch}.{name}_feat_out", rows)
    if shape.pooling == PoolingType.RANK:
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)


def tensor_plan(
    shape: Shape, vocab: int, types: Callable[[str, int], GGMLQuantizationType]
) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """Each tensor's (GGUF name, extent, type): vectors F32, matrices of `types` where the row fits."""
    plan: list[tuple[str, tuple[int, ...], GGMLQuantizationType]] = []
    for tensor, dims in tensor_shapes(shape):
        if len(dims) == 1:
            plan.append((tensor, dims, T.F32))
            continue
        *experts, rows, cols = dims
        rows = vocab if rows == -1 else rows
        asked = "token_embd.weight (tied)" if tensor == "token_embd.weight" and shape.tied else tensor
        qtype = T.F32 if tensor.endswith(KEPT_F32) else fitting(types(asked, shape.layers), cols)
        plan.append((tensor, (*experts, rows, cols), qtype))
    return plan


def tokenizer_fields(
    tokenizer: Path, shape: Shape, vocab_limit: int | None
) -> tuple[dict[str, GGUFValueType], dict]:
    """The tokenizer.* keys of the GGUF `tokenizer` (their kinds and values), its vocabulary cut to
    `vocab_limit`; an embedding model's inputs end with EOS (add_eos_token), as Qwen3-Embedding's."""
    source = GgufFile(tokenizer)  # the gguf package's reader takes seconds over a vocabulary
    kinds = {key: GGUFValueType(source.kinds[key]) for key in source.values if key.startswith("tokenizer.")}
    values = {key: source.values[key] for key in kinds}
    if vocab_limit is not None:
        values = cut_vocabulary(values, vocab_limit)
    if shape.pooling == PoolingType.LAST:
        kinds["tokenizer.ggml.add_eos_token"] = GGUFValueType.BOOL
        values["tokenizer.ggml.add_eos_token"] = True
    return kinds, values


def write_random_gguf(
    path: Path,
    shape: Shape,
    types: Callable[[str, int], GGMLQuantizationType],
    tokenizer: Path = DEFAULT_TOKENIZER,
    seed: int = 0,
    name: str = "random",
    vocab_limit: int | None = None,
    embed_scale: float = 0.02,
) -> Path:
    """A GGUF of `shape` (its arch) with random weights, each matrix of `types(gguf name, layers)`
    (the tied embedding asked as "token_embd.weight (tied)"), the vocabulary, merges (or scores)
    and chat template of the GGUF `tokenizer`, cut to `vocab_limit` tokens where given
    (cut_vocabulary: SentencePiece vocabularies). `embed_scale`: the embedding's weights' size (a
    tied one is the LM head: larger spreads tiny models' logits). Tensors are written one at a time
    (a 7B file is not held in memory)."""
    fields, values = tokenizer_fields(tokenizer, shape, vocab_limit)
    vocab = len(values["tokenizer.ggml.tokens"])
    writer = GGUFWriter(str(path), shape.arch)
    writer.add_name(name)
    add_shape(writer, shape, vocab)
    for key, kind in fields.items():
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, values[key])
        else:
            writer.add_key_value(key, values[key], kind)
    rng = np.random.default_rng(seed)
    plan = tensor_plan(shape, vocab, types)
    for tensor, extent, qtype in plan:
        if len(extent) == 1:
            writer.add_tensor_info(tensor, extent, np.dtype(np.float32), extent[0] * 4)
        elif qtype == T.F32:
            writer.add_tensor_info(tensor, extent, np.dtype(np.float32), int(np.prod(extent)) * 4)
        else:  # an expert tensor's leading axis: [experts, rows, row bytes]
            block, size = GGML_QUANT_SIZES[qtype]
            row_bytes = extent[-1] // block * size
            stored = (*extent[:-1], row_bytes)
            writer.add_tensor_info(tensor, stored, np.dtype(np.uint8), int(np.prod(stored)), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    head_name = "token_embd.weight" if shape.tied else "output.weight"
    head: tuple[np.ndarray, GGMLQuantizationType] = (np.zeros(0), T.F32)  # written before cls.output
    for tensor, extent, qtype in plan:
        if tensor == "cls.output.weight":  # the LM head's rows of the labels yes and no
            labels = [values["tokenizer.ggml.tokens"].index(label) for label in ("yes", "no")]
            data = dequantize(head[0][labels], head[1]).astype(np.float32).reshape(2, -1)
        else:
            data = random_tensor(tensor, extent, qtype, shape, vocab, rng, embed_scale)
        if tensor == head_name:
            head = (data, qtype)
        writer.write_tensor_data(data)
    writer.close()
    return path


def random_tensor(
    tensor: str,
    extent: tuple[int, ...],
    qtype: GGMLQuantizationType,
    shape: Shape,
    vocab: int,
    rng: np.random.Generator,
    embed_scale: float,
) -> np.ndarray:
    """A tensor's random data as the file holds it: norms near 1, decays, conv taps, matrices of
    `qtype` (write_random_gguf says their sizes)."""
    if tensor.endswith(("ssm_a", "ssm_dt.bias")):  # decays of about 0.9 a token
        return random_decay(tensor, extent, rng)
    if len(extent) == 1:
        return (1 + 0.1 * rng.standard_normal(extent)).astype(np.float32)
    if tensor.endswith("ssm_conv1d.weight"):
        return (rng.standard_normal(extent) / np.sqrt(extent[1])).astype(np.float32)
    scale = embed_scale if extent[0] == vocab else 0.02
    if shape.arch not in GEMMA and tensor.endswith(RESIDUAL_OUTPUTS):
        scale /= np.sqrt(2 * shape.layers)
    rows = int(np.prod(extent[:-1]))  # an expert tensor's experts one above the other
    return random_blocks(qtype, rows, extent[-1], rng, scale)


def random_decay(tensor: str, extent: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A Gated DeltaNet's A (-exp(A_log) < 0) or dt bias: exp(A softplus(a + dt)) about 0.9."""
    if tensor.endswith("ssm_a"):
        return -rng.uniform(0.05, 0.2, extent).astype(np.float32)
    return rng.normal(0.5, 0.2, extent).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a preset (or give every dimension)")
    for dim in ("hidden", "layers", "ffn", "heads", "kv-heads"):
        parser.add_argument(f"--{dim}", type=int, help="overrides the preset's")
    parser.add_argument("--untied", action="store_true", help="an output.weight of its own")
    parser.add_argument(
        "--arch", choices=DENSE_ARCHES, help="a dense preset's layers in another family's form"
    )
    parser.add_argument("--format", default="Q4_K_M", help="a GGML type name, Q4_K_M or Q5_K_M")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="GGUF to take it from")
    parser.add_argument("--vocab-limit", type=int, help="a SentencePiece vocabulary's first tokens only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dims = ("hidden", "layers", "ffn", "heads", "kv_heads")
    given = {name: getattr(args, name) for name in dims}
    if args.shape is None and None in given.values():
        parser.error("give --shape or every one of --hidden --layers --ffn --heads --kv-heads")
    shape = SHAPES[args.shape] if args.shape else Shape(**given)
    if args.arch and shape.arch not in DENSE_ARCHES:
        parser.error(f"--arch: the {shape.arch} preset is not a dense Llama-like one")
    shape = dataclasses.replace(
        shape,
        **{k: v for k, v in given.items() if v is not None},
        tied=shape.tied and not args.untied,
        arch=args.arch or shape.arch,
    )
    try:
        types = mix(args.format)
    except KeyError:
        parser.error(f"unknown format {args.format!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_random_gguf(
        args.out, shape, types, args.tokenizer, args.seed, f"random-{args.format}", args.vocab_limit
    )
    print(f"{args.out}: {shape}, {args.format}, {args.out.stat().st_size / 2**20:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
