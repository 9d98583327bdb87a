"""An independent numpy forward of a LLaMA-family model, the yardstick for the MindSpore graphs.

Qwen3 adds QK-norm (as Gemma's below, each query and key head RMS-normed before RoPE) and a head size
of its own; Phi-3 packs Q, K and V in one matrix and the FFN's gate and up in another (split here from
the file's rows); Mistral's and Phi-3's sliding window (config.json) applies to every layer; a GGUF's
rope_freqs tensor divides each RoPE frequency (llama.cpp's form of Llama 3's scaling).

It shares no code with agent/: it reads the weight files itself (gguf / safetensors directly), keeps
the files' own layouts, and for GGUF applies RoPE in the interleaved (GPT-J) order on the raw rows,
as llama.cpp does, instead of un-permuting them. Attention is computed per head with an explicit
repeat of the KV heads, in float64, so that it checks the graphs' float32 arithmetic too.

Gemma 3 (`general.architecture: gemma3`), as its description (the Gemma 3 report, HuggingFace's
Gemma3ForCausalLM) has it: the embedding's rows times sqrt(hidden); per layer RMSNorm -> Q, K, V; each
query and key head RMS-normed (q_norm, k_norm) -> RoPE in the rotate-half (NeoX) order, base 10,000
on local layers and the file's on global ones (every 6th layer: 5, 11, 17, ...) -> queries scaled by
1 / sqrt(key_length); a local layer's query at position i attends positions i - 511 .. i (a sliding
window of 512), a global one 0 .. i; output product -> RMSNorm (post_attention_norm) -> + residual;
RMSNorm -> down(gelu_tanh(gate) * up) -> RMSNorm (post_ffw_norm) -> + residual; final RMSNorm; the
tied embedding as the LM head. Gemma's RMSNorm multiplies by (1 + w): a GGUF holds 1 + w already
(llama.cpp's converter adds the 1), so the file's norm weights multiply as they are.

Qwen3.5 (`general.architecture: qwen35`), as transformers' Qwen3_5ForCausalLM has it, from llama.cpp's
file: a hybrid whose layers flagged in `attention.recurrent_layers` are Gated DeltaNet layers and the
others gated full attention; every norm but the DeltaNet's own holds 1 + w (as Gemma's). Attention:
attn_q's rows hold, per head, its query [hd] then its gate [hd]; each query and key head RMS-normed
(attn_q_norm, attn_k_norm) -> RoPE in the rotate-half order on the first `rope.dimension_count` dims
of the head only (the rest as they are) -> attention scaled 1 / sqrt(hd) -> times sigmoid(gate) ->
attn_output. Gated DeltaNet: attn_qkv's product (q, k of `ssm.group_count` key heads of
`ssm.state_size`, v of `ssm.time_step_rank` value heads) through the causal depthwise conv
(ssm_conv1d, `ssm.conv_kernel` taps) and silu; q and k L2-normed per head (FLA's eps 1e-6), q scaled by
1 / sqrt(key_dim); value head h reads key head h % key_heads (the converter's tiled order of the value
heads); beta = sigmoid(ssm_beta x), g = ssm_a * softplus(ssm_alpha x + ssm_dt.bias) (ssm_a is
-exp(A_log) already); the gated delta rule computed in its CHUNKED form (chunk_gated_delta, transformers'
torch_chunk_gated_delta_rule in numpy: chunks of 64 solved as triangular systems, then a scan over
chunks), a formulation apart from the kernel's token-by-token recurrence; its output RMS-normed by
ssm_norm (w as is) times silu(attn_gate x) -> ssm_out. The cache carries the attention layers' K and V
and each DeltaNet layer's state (the conv's last K - 1 inputs, each value head's [key_dim, value_dim]
matrix), so a forward goes on from where the last one stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np


@dataclass
class RefModel:
    layers: list[dict]
    embed: np.ndarray
    norm: np.ndarray
    head: np.ndarray
    n_heads: int
    n_kv: int
    head_dim: int
    theta: float
    eps: float
    interleaved_rope: bool
    rope_scaling: dict | None = None  # config.json's rope_scaling, or {"type": "linear", ...} from GGUF
    gemma: GemmaTraits | None = None
    qwen35: Qwen35Traits | None = None
    head_integer: bool = False  # the LM head's weights are in an integer GGUF format (int8 applies)
    freq_factors: np.ndarray | None = None  # a GGUF's rope_freqs: each frequency divided by its own
    window: int = 0  # Mistral's (and Phi-3's) sliding window, on every layer (0: none)


@dataclass
class GemmaTraits:
    """Gemma 3's departures from the LLaMA layer (module docstring)."""

    window: int  # positions a local layer attends, its own included
    local_layers: set[int]
    local_theta: float
    query_scale: float


@dataclass
class Qwen35Traits:
    """Qwen3.5's hybrid (module docstring): its Gated DeltaNet layers and their shape, its partial RoPE."""

    recurrent: set[int]
    rotary_dims: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


@dataclass
class RefCache:
    keys: list[list[np.ndarray]] = field(default_factory=list)
    values: list[list[np.ndarray]] = field(default_factory=list)
    # Per layer, the K and V [positions, n_kv, hd] that attention reads in place of the rows computed
    # here (those are still kept in keys and values): a server's own cache as it holds it (a q8_0
    # cache's rows, dequantized), so that a rounding which flips with the last float bit upstream
    # is compared as the server made it.
    read: list[tuple[np.ndarray, np.ndarray]] | None = None
    # Qwen3.5's Gated DeltaNet layers, by layer: the conv's last K - 1 inputs [K - 1, channels] and
    # each value head's state [value_heads, key_dim, value_dim] (none yet: zeros)
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    recurrent: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return max(map(len, self.keys), default=0)  # a DeltaNet layer keeps no K: its list is empty


# The layer's matrices: the reference's short names, the GGUF's tensor names.
MATRIX_NAMES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


def load_gguf_reference(path: str | Path) -> RefModel:
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    meta = lambda k: reader.fields[f"{arch}.{k}"].contents()  # noqa: E731
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    if arch == "qwen35":
        return _qwen35_reference(reader, raw)
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    integer = {t.name for t in reader.tensors if t.tensor_type not in floats}  # int8 activations apply
    n_layers = meta("block_count")
    heads, n_kv = meta("attention.head_count"), meta("attention.head_count_kv")
    head_dim = _field(reader, f"{arch}.attention.key_length") or meta("embedding_length") // heads
    layers = []
    for i in range(n_layers):
        p = f"blk.{i}."
        _unpack_phi3(raw, integer, p, heads * head_dim, n_kv * head_dim)
        layers.append(
            {
                "attn_norm": raw[p + "attn_norm.weight"],
                "q": raw[p + "attn_q.weight"],
                "k": raw[p + "attn_k.weight"],
                "v": raw[p + "attn_v.weight"],
                "o": raw[p + "attn_output.weight"],
                "ffn_norm": raw[p + "ffn_norm.weight"],
                "gate": raw[p + "ffn_gate.weight"],
                "up": raw[p + "ffn_up.weight"],
                "down": raw[p + "ffn_down.weight"],
                "bq": raw.get(p + "attn_q.bias"),
                "bk": raw.get(p + "attn_k.bias"),
                "bv": raw.get(p + "attn_v.bias"),
                "q_norm": raw.get(p + "attn_q_norm.weight"),
                "k_norm": raw.get(p + "attn_k_norm.weight"),
                "post_attn_norm": raw.get(p + "post_attention_norm.weight"),
                "post_ffn_norm": raw.get(p + "post_ffw_norm.weight"),
                "integer": {short for short, name in MATRIX_NAMES.items() if f"{p}{name}.weight" in integer},
            }
        )
    gemma = None
    if arch == "gemma3":
        gemma = GemmaTraits(
            window=meta("attention.sliding_window"),
            local_layers={i for i in range(n_layers) if (i + 1) % 6 != 0},
            local_theta=10000.0,
            query_scale=1.0 / np.sqrt(head_dim),
        )
    return RefModel(
        layers=layers,
        embed=raw["token_embd.weight"],
        norm=raw["output_norm.weight"],
        head=raw.get("output.weight", raw["token_embd.weight"]),
        head_integer=("output.weight" if "output.weight" in raw else "token_embd.weight") in integer,
        n_heads=heads,
        n_kv=n_kv,
        head_dim=head_dim,
        theta=float(meta("rope.freq_base")),
        freq_factors=raw.get("rope_freqs.weight"),
        eps=float(meta("attention.layer_norm_rms_epsilon")),
        interleaved_rope=(arch == "llama"),
        rope_scaling=_gguf_rope_scaling(reader, arch),
        gemma=gemma,
    )


def _qwen35_reference(reader, raw: dict[str, np.ndarray]) -> RefModel:
    """A qwen35 GGUF's model (module docstring), float weights only."""
    meta = lambda k: reader.fields[f"qwen35.{k}"].contents()  # noqa: E731
    n_layers, heads = int(meta("block_count")), int(meta("attention.head_count"))
    flags = _field(reader, "qwen35.attention.recurrent_layers")
    if flags is None:  # a file without the flags: every full_attention_interval-th layer attends
        flags = [(i + 1) % int(meta("full_attention_interval")) != 0 for i in range(n_layers)]
    value_heads = int(meta("ssm.time_step_rank"))
    traits = Qwen35Traits(
        recurrent={i for i in range(n_layers) if flags[i]},
        rotary_dims=int(meta("rope.dimension_count")),
        key_heads=int(meta("ssm.group_count")),
        value_heads=value_heads,
        key_dim=int(meta("ssm.state_size")),
        value_dim=int(meta("ssm.inner_size")) // value_heads,
        conv_kernel=int(meta("ssm.conv_kernel")),
    )
    layers = []
    for i in range(n_layers):
        p = f"blk.{i}."
        names = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ssm_conv1d", "ssm_norm")
        if i not in traits.recurrent:
            names = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
        layer = {name: raw[f"{p}{name}.weight"] for name in names}
        if i in traits.recurrent:
            layer |= {"ssm_a": raw[p + "ssm_a"], "ssm_dt": raw[p + "ssm_dt.bias"]}
        layer |= {
            "attn_norm": raw[p + "attn_norm.weight"],
            "ffn_norm": raw[p + "post_attention_norm.weight"],  # llama.cpp's name for Qwen3.5's
            "gate": raw[p + "ffn_gate.weight"],
            "up": raw[p + "ffn_up.weight"],
            "down": raw[p + "ffn_down.weight"],
        }
        layers.append(layer)
    return RefModel(
        layers=layers,
        embed=raw["token_embd.weight"],
        norm=raw["output_norm.weight"],
        head=raw.get("output.weight", raw["token_embd.weight"]),
        n_heads=heads,
        n_kv=int(meta("attention.head_count_kv")),
        head_dim=int(meta("attention.key_length")),
        theta=float(meta("rope.freq_base")),
        eps=float(meta("attention.layer_norm_rms_epsilon")),
        interleaved_rope=False,
        qwen35=traits,
    )


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _unpack_phi3(raw: dict, integer: set[str], p: str, q_rows: int, kv_rows: int) -> None:
    """Phi-3's packed layer matrices, as llama.cpp writes them, in place (and the parts of an
    integer-format one in `integer`): attn_qkv holds Q's rows, then K's, then V's; ffn_up (with no
    ffn_gate beside it) the gate's rows, then up's."""
    if p + "attn_qkv.weight" in raw:
        qkv = raw.pop(p + "attn_qkv.weight")
        raw[p + "attn_q.weight"], raw[p + "attn_k.weight"], raw[p + "attn_v.weight"] = np.split(
            qkv, [q_rows, q_rows + kv_rows]
        )
        if p + "attn_qkv.weight" in integer:
            integer |= {f"{p}attn_{name}.weight" for name in "qkv"}
    if p + "ffn_gate.weight" not in raw:
        raw[p + "ffn_gate.weight"], raw[p + "ffn_up.weight"] = np.split(raw[p + "ffn_up.weight"], 2)
        if p + "ffn_up.weight" in integer:
            integer.add(p + "ffn_gate.weight")


def _gguf_rope_scaling(reader, arch: str) -> dict | None:
    kind = reader.fields.get(f"{arch}.rope.scaling.type")
    if kind is None or kind.contents() == "none":
        return None
    return {"type": kind.contents(), "factor": reader.fields[f"{arch}.rope.scaling.factor"].contents()}


def load_hf_reference(directory: str | Path) -> RefModel:
    from safetensors.numpy import load_file

    directory = Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    raw: dict[str, np.ndarray] = {}
    for f in sorted(directory.glob("*.safetensors")):
        raw.update({k: v.astype(np.float64) for k, v in load_file(str(f)).items()})
    if cfg["model_type"] == "internlm2":
        raw = _from_internlm2(raw, cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n_kv = cfg.get("num_key_value_heads", heads)
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if p + "self_attn.qkv_proj.weight" in raw:  # Phi-3: Q, K, V rows packed in turn, gate then up
            qkv = raw[p + "self_attn.qkv_proj.weight"]
            q_rows, kv_rows = heads * head_dim, n_kv * head_dim
            for name, part in zip("qkv", np.split(qkv, [q_rows, q_rows + kv_rows])):
                raw[p + f"self_attn.{name}_proj.weight"] = part
            gate_up = np.split(raw[p + "mlp.gate_up_proj.weight"], 2)
            raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"] = gate_up
        layers.append(
            {
                "attn_norm": raw[p + "input_layernorm.weight"],
                "q": raw[p + "self_attn.q_proj.weight"],
                "k": raw[p + "self_attn.k_proj.weight"],
                "v": raw[p + "self_attn.v_proj.weight"],
                "o": raw[p + "self_attn.o_proj.weight"],
                "ffn_norm": raw[p + "post_attention_layernorm.weight"],
                "gate": raw[p + "mlp.gate_proj.weight"],
                "up": raw[p + "mlp.up_proj.weight"],
                "down": raw[p + "mlp.down_proj.weight"],
                "bq": raw.get(p + "self_attn.q_proj.bias"),
                "bk": raw.get(p + "self_attn.k_proj.bias"),
                "bv": raw.get(p + "self_attn.v_proj.bias"),
                "q_norm": raw.get(p + "self_attn.q_norm.weight"),  # Qwen3
                "k_norm": raw.get(p + "self_attn.k_norm.weight"),
                "integer": set(),  # float weights: int8 activations never apply
            }
        )
    embed = raw["model.embed_tokens.weight"]
    window = cfg.get("sliding_window") if cfg["model_type"] in ("mistral", "phi3") else None
    rope = cfg.get("rope_parameters") or {}  # transformers 5's config.json: base and scaling in one
    scaled_rope = None if rope.get("rope_type", "default") == "default" else rope
    return RefModel(
        layers=layers,
        embed=embed,
        norm=raw["model.norm.weight"],
        head=raw.get("lm_head.weight", embed),
        n_heads=heads,
        n_kv=n_kv,
        head_dim=head_dim,
        theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        eps=float(cfg["rms_norm_eps"]),
        interleaved_rope=False,
        rope_scaling=cfg.get("rope_scaling") or scaled_rope,
        window=window if window and window < cfg["max_position_embeddings"] else 0,
    )


def _from_internlm2(raw: dict, cfg: dict) -> dict:
    """InternLM2 names -> Llama names; wqkv holds, per KV head, its group of query heads then K then V."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    per_kv = heads // kv + 2
    out = {
        "model.embed_tokens.weight": raw["model.tok_embeddings.weight"],
        "model.norm.weight": raw["model.norm.weight"],
    }
    if "output.weight" in raw:
        out["lm_head.weight"] = raw["output.weight"]
    for i in range(cfg["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        wqkv = raw[src + "attention.wqkv.weight"]
        q_rows, k_rows, v_rows = [], [], []
        for h in range(kv):
            block = wqkv[h * per_kv * hd : (h + 1) * per_kv * hd]
            q_rows.append(block[: (per_kv - 2) * hd])
            k_rows.append(block[(per_kv - 2) * hd : (per_kv - 1) * hd])
            v_rows.append(block[(per_kv - 1) * hd :])
        out[dst + "self_attn.q_proj.weight"] = np.concatenate(q_rows)
        out[dst + "self_attn.k_proj.weight"] = np.concatenate(k_rows)
        out[dst + "self_attn.v_proj.weight"] = np.concatenate(v_rows)
        out[dst + "self_attn.o_proj.weight"] = raw[src + "attention.wo.weight"]
        out[dst + "input_layernorm.weight"] = raw[src + "attention_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = raw[src + "ffn_norm.weight"]
        out[dst + "mlp.gate_proj.weight"] = raw[src + "feed_forward.w1.weight"]
        out[dst + "mlp.up_proj.weight"] = raw[src + "feed_forward.w3.weight"]
        out[dst + "mlp.down_proj.weight"] = raw[src + "feed_forward.w2.weight"]
    return out


def _frequencies(theta: float, hd: int, scaling: dict | None) -> np.ndarray:
    """RoPE frequencies; scaling as HuggingFace's transformers defines linear and llama3."""
    freqs = theta ** (-np.arange(0, hd, 2) / hd)
    if not scaling:
        return freqs
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return freqs / scaling["factor"]
    assert kind == "llama3", kind
    old_len = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    out = []
    for f in freqs:
        wavelength = 2 * np.pi / f
        if wavelength < old_len / high:
            out.append(f)
        elif wavelength > old_len / low:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, interleaved: bool) -> np.ndarray:
    """x: [T, heads, hd]."""
    hd = x.shape[-1]
    ang = positions[:, None, None] * freqs[None, None, :]  # [T, 1, hd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    if interleaved:  # pairs (2i, 2i+1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def q8_1(
    x: np.ndarray, near_ties: list[int] | None = None, jitter: np.random.Generator | None = None
) -> np.ndarray:
    """x as llama.cpp's Q8_1 activations hold it: each block of 32 in float32 rounded to the grid of
    d = max |x| / 127 (to nearest, ties to even), then dequantized (d * q) in float64. near_ties: gets
    the count of values near a rounding boundary (TIE_ULPS), where a float32 input a few ulps away
    (summed in another order) rounds the other way: either answer is right. jitter: each value first
    moved one float32 ulp up or down at random, as a float32 implementation's inputs differ from this
    float64 forward's (forward's ulp_jitter: how far the int8 answer moves on that alone)."""
    if jitter is not None:
        x32 = x.astype(np.float32)
        away = np.where(jitter.random(x32.shape) < 0.5, np.inf, -np.inf).astype(np.float32)
        x = np.nextafter(x32, away)
    dequantized, tie_steps = _q8_1_with_ties(x)
    if near_ties is not None:
        near_ties.append(int(np.count_nonzero(tie_steps)))
    return dequantized


def _q8_1_with_ties(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q8_1(x), and for each value near a rounding boundary the step (d) it moves by if rounded the
    other way (0 elsewhere)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scaled = blocks * (np.float32(127) / np.where(amax > 0, amax, np.float32(1)))  # all-zero blocks: 0
    margin = (np.abs(scaled) + 1) * (TIE_ULPS * 2.0**-24)
    tied = np.abs(np.abs(scaled - np.trunc(scaled)) - 0.5) < margin
    step = (amax / np.float32(127)).astype(np.float64)
    dequantized = np.rint(scaled).astype(np.float64) * step
    return dequantized.reshape(x.shape), np.where(tied, step, 0.0).reshape(x.shape)


# A scaled value this many of its float32 ulps from a rounding boundary is a tie: the kernels'
# activations differ from the reference's by a few ulps (an attention output by two, measured).
TIE_ULPS = 8


def _q8_0_rounded(rows: np.ndarray) -> np.ndarray:
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(rows.astype(np.float32), q8_0), q8_0).astype(
        np.float64
    )


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def forward(
    model: RefModel,
    tokens: list[int],
    cache: RefCache,
    int8: bool = False,
    near_ties: list[int] | None = None,
    head_slack: list[np.ndarray] | None = None,
    q8_0_cache: bool = False,
    ulp_jitter: np.random.Generator | None = None,
    activations: Callable[[np.ndarray, int, str], np.ndarray] | None = None,
) -> np.ndarray:
    """Run `tokens` after what `cache` already holds; returns logits [len(tokens), vocab]. int8: the
    input of every layer product whose weights are in an integer GGUF format rounded to Q8_1 first
    (runtime.activations: int8), the LM head's too; not float weights. near_ties: as q8_1's, a count
    for each rounding of the layers' inputs. activations: each layer product's input (a, the layer's
    index, the product: q k v o gate up down) as the product rounds it first (an int8 checkpoint's
    activation quantization). head_slack: gets how far each logit [len(tokens), vocab]
    moves should the LM head's input round its near ties the other way (they touch only the logits,
    so they are allowed for there instead of counting as ties). q8_0_cache: each new K and V row is
    kept as gguf's Q8_0 of its float32 value (runtime.kv_cache_dtype: q8_0, llama.cpp's -ctk/-ctv
    q8_0) and attended as gguf dequantizes it. ulp_jitter (with int8): every rounded input, the LM
    head's too, first moved one float32 ulp at random (q8_1's jitter)."""
    if model.qwen35 is not None:  # float weights, float products only
        assert not (int8 or q8_0_cache or activations is not None or cache.read is not None)
        return _qwen35_forward(model, tokens, cache)

    def product(a: np.ndarray, layer: dict, name: str) -> np.ndarray:
        if activations is not None:
            a = activations(a, next(i for i, held in enumerate(model.layers) if held is layer), name)
        return (q8_1(a, near_ties, ulp_jitter) if int8 and name in layer["integer"] else a) @ layer[name].T

    start = cache.length
    positions = np.arange(start, start + len(tokens), dtype=np.float64)
    x = model.embed[np.asarray(tokens)]
    gemma = model.gemma
    if gemma is not None:
        x = x * np.sqrt(x.shape[1])
    freqs = _frequencies(model.theta, model.head_dim, model.rope_scaling)
    if model.freq_factors is not None:
        freqs = freqs / model.freq_factors
    if not cache.keys:
        cache.keys = [[] for _ in model.layers]
        cache.values = [[] for _ in model.layers]
    for li, layer in enumerate(model.layers):
        local = gemma is not None and li in gemma.local_layers
        layer_freqs = _frequencies(gemma.local_theta, model.head_dim, None) if local and gemma else freqs
        h = _rms(x, layer["attn_norm"], model.eps)
        attended = _attention(model, li, h, positions, layer_freqs, cache, product, q8_0_cache)
        attended = product(attended, layer, "o")
        if gemma is not None:
            attended = _rms(attended, layer["post_attn_norm"], model.eps)
        x = x + attended
        x = x + _ffn(model, layer, _rms(x, layer["ffn_norm"], model.eps), product)
    return _lm_head(model, _rms(x, model.norm, model.eps), int8, head_slack, ulp_jitter)


def _attention(
    model: RefModel,
    li: int,
    h: np.ndarray,
    positions: np.ndarray,
    freqs: np.ndarray,
    cache: RefCache,
    product: Callable[[np.ndarray, dict, str], np.ndarray],
    q8_0_cache: bool,
) -> np.ndarray:
    """Layer li's attention of the normed rows h (at `positions`, RoPE of `freqs`) over what the cache
    holds and their own K and V, which it appends: [T, heads * hd], before the output product."""
    layer, gemma, hd, n = model.layers[li], model.gemma, model.head_dim, len(h)
    q, k, v = product(h, layer, "q"), product(h, layer, "k"), product(h, layer, "v")
    if layer["bq"] is not None:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(n, model.n_heads, hd)
    k = k.reshape(n, model.n_kv, hd)
    if layer.get("q_norm") is not None:  # Gemma 3, Qwen3
        q, k = _rms(q, layer["q_norm"], model.eps), _rms(k, layer["k_norm"], model.eps)
    q = _rope(q, positions, freqs, model.interleaved_rope)
    k = _rope(k, positions, freqs, model.interleaved_rope)
    v = v.reshape(n, model.n_kv, hd)
    if q8_0_cache:
        k, v = _q8_0_rounded(k), _q8_0_rounded(v)
    cache.keys[li].extend(k)
    cache.values[li].extend(v)
    keys, values = np.stack(cache.keys[li]), np.stack(cache.values[li])  # [T_all, n_kv, hd]
    if cache.read is not None:
        keys, values = (np.asarray(a[: len(keys)], np.float64) for a in cache.read[li])
    key_positions = np.arange(keys.shape[0])[None, :]
    hidden = key_positions > positions[:, None]  # causal
    if gemma is not None and li in gemma.local_layers:
        hidden |= key_positions <= positions[:, None] - gemma.window
    if model.window:
        hidden |= key_positions <= positions[:, None] - model.window
    scale = gemma.query_scale if gemma else 1.0 / np.sqrt(hd)
    group = model.n_heads // model.n_kv
    out = np.empty((n, model.n_heads, hd))
    for head in range(model.n_heads):
        kv_head = head // group
        scores = q[:, head] @ keys[:, kv_head].T * scale  # [T, T_all]
        scores = np.where(hidden, -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, head] = (scores / scores.sum(axis=-1, keepdims=True)) @ values[:, kv_head]
    return out.reshape(n, -1)


def _ffn(
    model: RefModel, layer: dict, h: np.ndarray, product: Callable[[np.ndarray, dict, str], np.ndarray]
) -> np.ndarray:
    """The layer's FFN of the normed rows h: down(act(gate) * up), Gemma's GELU (tanh) and post-norm,
    else SiLU."""
    gate = product(h, layer, "gate")
    if model.gemma is not None:
        return _rms(
            product(_gelu_tanh(gate) * product(h, layer, "up"), layer, "down"),
            layer["post_ffn_norm"],
            model.eps,
        )
    return product((gate / (1.0 + np.exp(-gate))) * product(h, layer, "up"), layer, "down")


def _lm_head(
    model: RefModel,
    h: np.ndarray,
    int8: bool,
    head_slack: list[np.ndarray] | None,
    ulp_jitter: np.random.Generator | None,
) -> np.ndarray:
    """The logits of the final-normed rows h; with int8 and an integer head, h rounded to Q8_1 first
    (forward's head_slack and ulp_jitter)."""
    if not (int8 and model.head_integer):
        return h @ model.head.T
    if ulp_jitter is not None:
        return q8_1(h, jitter=ulp_jitter) @ model.head.T
    h, tie_steps = _q8_1_with_ties(h)
    if head_slack is not None:
        head_slack.append(tie_steps @ np.abs(model.head).T)
    return h @ model.head.T


# ------------------------------------------------------------------------------------------ Qwen3.5

CHUNK = 64  # transformers' (and FLA's) chunk of the gated delta rule


def _qwen35_forward(model: RefModel, tokens: list[int], cache: RefCache) -> np.ndarray:
    """Qwen3.5's forward of `tokens` after what `cache` holds (module docstring) -> logits [T, vocab]."""
    traits = model.qwen35
    assert traits is not None
    positions = np.arange(cache.length, cache.length + len(tokens), dtype=np.float64)
    freqs = model.theta ** (-np.arange(0, traits.rotary_dims, 2) / traits.rotary_dims)
    if not cache.keys:
        cache.keys = [[] for _ in model.layers]
        cache.values = [[] for _ in model.layers]
    x = model.embed[np.asarray(tokens)]
    for li, layer in enumerate(model.layers):
        h = _rms(x, layer["attn_norm"], model.eps)
        if li in traits.recurrent:
            x = x + _gated_delta_net(model, li, h, cache)
        else:
            x = x + _gated_attention(model, li, h, positions, freqs, cache)
        h = _rms(x, layer["ffn_norm"], model.eps)
        x = x + (_silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T
    return _rms(x, model.norm, model.eps) @ model.head.T


def _gated_attention(
    model: RefModel, li: int, h: np.ndarray, positions: np.ndarray, freqs: np.ndarray, cache: RefCache
) -> np.ndarray:
    """Layer li's gated attention of the normed rows h over the cache's K and V and their own (appended),
    through attn_output: [T, hidden]."""
    layer, hd, n, rot = model.layers[li], model.head_dim, len(h), model.qwen35.rotary_dims
    query_gate = (h @ layer["attn_q"].T).reshape(n, model.n_heads, 2, hd)  # per head: query, then gate
    q, gate = query_gate[:, :, 0], query_gate[:, :, 1]
    k = (h @ layer["attn_k"].T).reshape(n, model.n_kv, hd)
    v = (h @ layer["attn_v"].T).reshape(n, model.n_kv, hd)
    q, k = _rms(q, layer["attn_q_norm"], model.eps), _rms(k, layer["attn_k_norm"], model.eps)
    q = np.concatenate([_rope(q[..., :rot], positions, freqs, False), q[..., rot:]], axis=-1)
    k = np.concatenate([_rope(k[..., :rot], positions, freqs, False), k[..., rot:]], axis=-1)
    cache.keys[li].extend(k)
    cache.values[li].extend(v)
    keys, values = np.stack(cache.keys[li]), np.stack(cache.values[li])
    hidden = np.arange(len(keys))[None, :] > positions[:, None]  # causal
    group = model.n_heads // model.n_kv
    out = np.empty((n, model.n_heads, hd))
    for head in range(model.n_heads):
        scores = q[:, head] @ keys[:, head // group].T / np.sqrt(hd)
        scores = np.exp(np.where(hidden, -np.inf, scores) - scores.max(axis=-1, keepdims=True))
        out[:, head] = scores / scores.sum(axis=-1, keepdims=True) @ values[:, head // group]
    out = out / (1.0 + np.exp(-gate))  # times sigmoid(gate)
    return out.reshape(n, -1) @ layer["attn_output"].T


def _gated_delta_net(model: RefModel, li: int, h: np.ndarray, cache: RefCache) -> np.ndarray:
    """Layer li's Gated DeltaNet of the normed rows h from the cache's state (left there), through
    ssm_out: [T, hidden]."""
    t, layer, n = model.qwen35, model.layers[li], len(h)
    hk, hv, dk, dv, taps = t.key_heads, t.value_heads, t.key_dim, t.value_dim, t.conv_kernel
    mixed = h @ layer["attn_qkv"].T  # [T, channels]
    held = cache.conv.get(li, np.zeros((taps - 1, mixed.shape[1])))
    inputs = np.concatenate([held, mixed])
    cache.conv[li] = inputs[len(inputs) - (taps - 1) :]
    windows = np.lib.stride_tricks.sliding_window_view(inputs, taps, axis=0)  # [T, channels, taps]
    y = _silu((windows * layer["ssm_conv1d"]).sum(axis=-1))
    q = y[:, : hk * dk].reshape(n, hk, dk)
    k = y[:, hk * dk : 2 * hk * dk].reshape(n, hk, dk)
    v = y[:, 2 * hk * dk :].reshape(n, hv, dv)
    q = q / np.sqrt((q * q).sum(axis=-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(axis=-1, keepdims=True) + 1e-6)
    reads = np.arange(hv) % hk  # value head h's key head, the file's tiled order
    beta = 1.0 / (1.0 + np.exp(-(h @ layer["ssm_beta"].T)))
    g = layer["ssm_a"] * np.logaddexp(0.0, h @ layer["ssm_alpha"].T + layer["ssm_dt"])  # log decay
    out, state = chunk_gated_delta(q[:, reads], k[:, reads], v, g, beta, cache.recurrent.get(li))
    cache.recurrent[li] = state
    z = (h @ layer["attn_gate"].T).reshape(n, hv, dv)
    return (_rms(out, layer["ssm_norm"], model.eps) * _silu(z)).reshape(n, -1) @ layer["ssm_out"].T


def chunk_gated_delta(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray | None = None,
    chunk: int = CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule S_t = e^g_t S_{t-1} + k_t (beta_t (v_t - e^g_t S_{t-1}^T k_t))^T, o_t = S_t^T q_t
    of each head (q, k [T, H, dk], v [T, H, dv], g, beta [T, H]; q as it is, no scale) from `state`
    [H, dk, dv] (None: zeros), in transformers' chunked form (torch_chunk_gated_delta_rule): the
    sequence zero-padded to chunks; within a chunk the delta rule's updates are solved at once as a
    unit lower-triangular system (the UT transform), then the chunks are scanned, each reading the
    state the ones before left. -> o [T, H, dv] and the final state [H, dk, dv]."""
    steps, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -steps % chunk

    def chunked(a: np.ndarray) -> np.ndarray:  # [T, H, ...] -> [H, chunks, chunk, ...]
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]))])
        return np.moveaxis(a, 0, 1).reshape(heads, -1, chunk, *a.shape[2:])

    q, k, v, g, beta = (chunked(a) for a in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = np.cumsum(g, axis=-1)  # [H, N, C]: log of the decay from the chunk's start to each position
    lower = np.tril(np.ones((chunk, chunk), dtype=bool))  # j <= i
    pairwise = cum[..., :, None] - cum[..., None, :]  # [H, N, C, C]: log decay from j to i
    decay = np.where(lower, np.exp(np.where(lower, pairwise, 0.0)), 0.0)
    kt = np.swapaxes(k, -1, -2)
    system = np.tril(k_beta @ kt * decay, -1) + np.eye(chunk)  # unit lower triangular
    new_values = np.linalg.solve(system, v_beta)  # [H, N, C, dv]
    k_cumdecay = np.linalg.solve(system, k_beta * np.exp(cum)[..., None])  # [H, N, C, dk]
    within = q @ kt * decay  # [H, N, C, C]: attention inside the chunk, diagonal included
    q_decayed = q * np.exp(cum)[..., None]
    k_decayed = k * np.exp(cum[..., -1:] - cum)[..., None]
    state = np.zeros((heads, dk, dv)) if state is None else np.array(state, dtype=np.float64)
    out = np.empty_like(new_values)
    for i in range(new_values.shape[1]):
        fresh = new_values[:, i] - k_cumdecay[:, i] @ state  # what the state does not predict
        out[:, i] = q_decayed[:, i] @ state + within[:, i] @ fresh
        state = state * np.exp(cum[:, i, -1])[:, None, None] + np.swapaxes(k_decayed[:, i], -1, -2) @ fresh
    return np.moveaxis(out.reshape(heads, -1, dv)[:, :steps], 0, 1), state


def greedy(
    model: RefModel, prompt: list[int], n_new: int, stop_ids=(), q8_0_cache: bool = False
) -> list[int]:
    cache = RefCache()
    logits = forward(model, prompt, cache, q8_0_cache=q8_0_cache)[-1]
    out: list[int] = []
    for _ in range(n_new):
        token = int(np.argmax(logits))
        out.append(token)
        if token in stop_ids:
            break
        logits = forward(model, [token], cache, q8_0_cache=q8_0_cache)[-1]
    return out
