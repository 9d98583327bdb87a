"""A known-answer check of the compiled graphs, run by every warm-up before an agent reports ready.

Graphs can come from MindSpore's compile cache or from MindIR files, and a cache that does not fit
the model (a stale key, a copied or corrupted entry, a kernel built for other code) gives garbage
with no error. So warm-up runs each graph on a short probe prompt and compares its output with a
plain numpy forward of the same weights (computed here, never by a graph): prefill logits, decode
logits at every batch bucket, the post-process graphs' argmax and top-k, and the K/V a transfer
moves. A MindIR export stores the expected values beside its files (`known_answer.npz`), computed
at export time from the checkpoint.

Cost for the default model: the numpy forward of 5 tokens takes ~0.1 s; the graph runs replace
warm-up runs that happened anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from agent.graphs.cache_format import dequantize_rows, quantize_rows
from agent.model.checkpoint import Checkpoint
from config.schema import RuntimeSection

FILE_NAME = "known_answer.npz"
PROBE_LENGTH = 4  # prompt tokens; the decode step adds one more
# Max |difference| allowed, relative to the largest |expected logit| (floor 1): float32 graphs agree
# with the numpy forward to ~1e-5 of that; a graph that does not fit the weights is off by O(1).
# "int8": a call that takes the opt-in int8 products (runtime.activations): the default model's
# logits move by ~2-3% of the largest from float32's, and as much between two int8 implementations
# that round a few activations the other way (float32 against float64 inputs).
# "q8_0": a float32 model over a q8_0 KV cache, against a numpy forward that rounds its K and V as
# the cache does; a K or V a float32 ulp apart on either side may round to the next quant.
TOLERANCE = {"float32": 2e-3, "float16": 5e-2, "bfloat16": 1e-1, "int8": 1e-1, "q8_0": 1e-2}


class KnownAnswerError(RuntimeError):
    """A graph's output disagrees with the numpy forward of the weights it should hold."""


class Int8AllowanceError(KnownAnswerError):
    """A call with int8 activations moved the logits past TOLERANCE["int8"]: a model whose answers
    int8 changes that much (deep random weights do) serves with float32 activations."""


@dataclass(frozen=True)
class KnownAnswer:
    tokens: np.ndarray  # [n + 1] the probe prompt (n <= PROBE_LENGTH), then the decode step's token
    prefill_logits: np.ndarray  # [V] after the prompt
    decode_logits: np.ndarray  # [V] after the decode token
    kv: np.ndarray | None = None  # [2 * layers, KV heads, n, head_dim] the prompt's K and V (float32)
    # the Gated DeltaNet layers' states after the prompt (numpy_forward's), () without such layers
    states: tuple[np.ndarray, ...] = ()
    # an encoder's (ModelSpec.bidirectional): the prompt's last row's final hidden state [D], what its
    # prefill and mixed graphs are held to (they run no LM head: their logits are zeros)
    prefill_hidden: np.ndarray | None = None

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[:-1]

    @property
    def decode_token(self) -> int:
        return int(self.tokens[-1])

    @classmethod
    def of_checkpoint(cls, checkpoint: Checkpoint, runtime: RuntimeSection) -> KnownAnswer:
        checkpoint = checkpoint.whole()  # a rank's share: the group computes the whole model's logits
        tokens = probe_tokens(checkpoint.spec.vocab_size, probe_length(runtime))
        quantized_kv = runtime.kv_cache_dtype == "q8_0"
        normed, kv, states = numpy_forward(
            checkpoint,
            tokens,
            kernels=runtime.matmul_kernel,
            quantized_kv=quantized_kv,
            states_at=len(tokens) - 1,
            final_hidden=True,
        )
        logits = head_logits(checkpoint, normed, runtime.matmul_kernel)
        hidden = normed[-2] if checkpoint.spec.bidirectional else None
        return cls(tokens, logits[-2], logits[-1], kv[:, :, :-1], tuple(states), hidden)

    def save(self, directory: Path) -> Path:
        path = directory / FILE_NAME
        hidden = {} if self.prefill_hidden is None else {"prefill_hidden": self.prefill_hidden}
        np.savez(
            path,
            tokens=self.tokens,
            prefill_logits=self.prefill_logits,
            decode_logits=self.decode_logits,
            **hidden,
        )
        return path

    @classmethod
    def load(cls, directory: Path) -> KnownAnswer:
        with np.load(directory / FILE_NAME) as stored:
            hidden = stored["prefill_hidden"] if "prefill_hidden" in stored else None
            return cls(
                stored["tokens"], stored["prefill_logits"], stored["decode_logits"], prefill_hidden=hidden
            )


def probe_length(runtime: RuntimeSection) -> int:
    """The probe prompt fits the smallest prefill bucket, and with its decode token the smallest
    attended length of the gather path."""
    limits = [PROBE_LENGTH, runtime.prefill_buckets[0], runtime.planned_max_seq_len - 1]
    if not runtime.attention_kernel:
        limits.append(runtime.attend_buckets[0] - 1)
    return max(1, min(limits))


def probe_tokens(vocab_size: int, length: int) -> np.ndarray:
    """`length` prompt ids and a decode token: fixed, spread over the vocabulary; any ids would do."""
    return (np.arange(1, length + 2, dtype=np.int64) * 7919) % vocab_size


def compare(what: str, got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    scale = max(1.0, float(np.abs(expected).max()))
    diff = float(np.abs(np.asarray(got, np.float32) - expected).max())
    if not np.isfinite(diff) or diff > TOLERANCE[dtype] * scale:
        raise (Int8AllowanceError if dtype == "int8" else KnownAnswerError)(
            f"the {what} graph disagrees with a numpy forward of the loaded weights "
            f"(max |difference| {diff:.3g}, allowed {TOLERANCE[dtype] * scale:.3g})"
        )


def check_post_process(
    what: str, logits: np.ndarray, ids: np.ndarray, values: np.ndarray | None = None
) -> None:
    """argmax / top-k outputs: each chosen id holds the row's largest logits (ties may pick either)."""
    k = ids.shape[-1] if ids.ndim == 2 else 1
    ids = ids.reshape(len(logits), k)
    want = -np.sort(-logits, axis=1)[:, :k]
    chosen = np.take_along_axis(logits, ids.astype(np.int64), axis=1)
    if not np.array_equal(chosen, want) or (values is not None and not np.allclose(values, want)):
        raise KnownAnswerError(f"the {what} graph does not return the largest logits of its input")


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (the checkpoint's canonical Q/K row order) of the first cos.shape[-1] dims
    of each head (all of them but with partial RoPE); x [heads, S, hd]."""
    dims = cos.shape[-1]
    x, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return np.concatenate([x * cos + rotated * sin, rest], axis=-1)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _gated_delta(
    h: np.ndarray, p: str, checkpoint: Checkpoint, product, kept: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Gated DeltaNet layer's mixer over its normed rows h [S, hidden] from a zero state ->
    [S, value_heads * value_dim] (before delta_out), token by token (agent/kernels/gated_delta.h),
    and its state after the first `kept` rows as a slot holds it: the last K - 1 conv inputs [K - 1,
    channels] (oldest first) and each value head's recurrent matrix [value_heads, key_dim, value_dim]."""
    shape, t = checkpoint.spec.linear_attention, checkpoint.tensors
    assert shape is not None
    n, kernel, channels = len(h), shape.conv_kernel, shape.channels
    hk, hv, dk, dv = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    inputs = np.concatenate([np.zeros((kernel - 1, channels), np.float32), product(h, p + "delta_qkv")])
    conv = t[p + "delta_conv"].reshape(channels, kernel)
    y = _silu(sum(inputs[j : j + n] * conv[:, j] for j in range(kernel)))
    q, k = y[:, : hk * dk].reshape(n, hk, dk), y[:, hk * dk : 2 * hk * dk].reshape(n, hk, dk)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.float32(np.sqrt(dk))
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    heads = np.arange(hv) % hk  # value head h reads key head h % key_heads
    q, k, v = q[:, heads], k[:, heads], y[:, 2 * hk * dk :].reshape(n, hv, dv)
    beta = 1 / (1 + np.exp(-(h @ checkpoint.matrix(p + "delta_beta").T)))
    a = h @ checkpoint.matrix(p + "delta_alpha").T + t[p + "delta_dt_bias"]
    decay = np.exp(t[p + "delta_a"] * np.logaddexp(0, a))  # A * softplus(a + dt_bias)
    state = np.zeros((hv, dk, dv), np.float32)
    out = np.zeros((n, hv, dv), np.float32)
    held = state.copy()
    for i in range(n):
        state *= decay[i][:, None, None]
        delta = (v[i] - np.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
        state += k[i][:, :, None] * delta[:, None, :]
        out[i] = np.einsum("hkv,hk->hv", state, q[i])
        if i == kept - 1:
            held = state.copy()
    z = product(h, p + "delta_z").reshape(n, hv, dv)
    mixed = (_rms_norm(out, t[p + "delta_norm"], checkpoint.spec.rms_eps) * _silu(z)).reshape(n, -1)
    return mixed, inputs[kept : kept + kernel - 1], held


def _experts(h: np.ndarray, p: str, checkpoint: Checkpoint, product) -> np.ndarray:
    """A MoE layer's FFN (Qwen3-MoE's): each row's top-k experts by the router's softmax, weighted;
    and its shared expert's output (Qwen3.5-MoE's), weighted by sigmoid(h . shared_expert_gate)."""
    spec = checkpoint.spec
    logits = h @ checkpoint.matrix(p + "router").T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, -1, kind="stable")[:, : spec.experts_per_token]
    weights = np.take_along_axis(probs, chosen, -1)
    if spec.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)
        gate = product(h[rows], f"{p}experts.{e}.w_gate")
        act = gate / (1 + np.exp(-gate)) * product(h[rows], f"{p}experts.{e}.w_up")
        out[rows] += weights[rows, slot][:, None] * product(act, f"{p}experts.{e}.w_down")
    if spec.shared_expert_intermediate_size:
        gate = product(h, f"{p}shared_expert.w_gate")
        act = gate / (1 + np.exp(-gate)) * product(h, f"{p}shared_expert.w_up")
        weight = 1 / (1 + np.exp(-product(h, f"{p}shared_expert_gate")))
        out += weight * product(act, f"{p}shared_expert.w_down")
    return out


def _attention(
    h: np.ndarray,
    p: str,
    checkpoint: Checkpoint,
    product,
    rope: tuple[np.ndarray, np.ndarray],
    mask: np.ndarray,
    quantized_kv: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's attention over its normed rows h [S, hidden] -> the attended rows [S, heads * hd]
    (before wo), and its K (after RoPE) and V [KV heads, S, hd] as the cache holds them."""
    spec, t = checkpoint.spec, checkpoint.tensors
    n, hd, kv_heads, group = len(h), spec.head_dim, spec.num_kv_heads, spec.group_size
    cos, sin = rope
    q, k, v = (
        product(h, p + name) + t.get(p + bias, 0) for name, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))
    )
    gate = None
    if spec.output_gate:  # each head's query, then its gate (Qwen3.5's)
        q, gate = q.reshape(n, -1, 2, hd)[:, :, 0], q.reshape(n, -1, 2, hd)[:, :, 1].reshape(n, -1)
    q, k = q.reshape(n, -1, hd).transpose(1, 0, 2), k.reshape(n, kv_heads, hd).transpose(1, 0, 2)
    if spec.qk_norm:
        q, k = _rms_norm(q, t[p + "q_norm"], spec.rms_eps), _rms_norm(k, t[p + "k_norm"], spec.rms_eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    v = v.reshape(n, kv_heads, hd).transpose(1, 0, 2)
    if quantized_kv:  # attention reads what the cache holds
        k, v = dequantize_rows(quantize_rows(k)), dequantize_rows(quantize_rows(v))
    scores = q @ np.repeat(k, group, axis=0).transpose(0, 2, 1) * np.float32(spec.query_scale) + mask
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = (probs @ np.repeat(v, group, axis=0)).transpose(1, 0, 2).reshape(n, -1)
    if gate is not None:
        attended = attended / (1 + np.exp(-gate))
    return attended, k, v


def _gated_ffn(h: np.ndarray, p: str, activation: str, product) -> np.ndarray:
    """A dense layer's FFN: w_down(act(w_gate h) * w_up h), act GELU (tanh) or SiLU."""
    gate = product(h, p + "w_gate")
    if activation == "gelu_tanh":
        gate = 0.5 * gate * (1 + np.tanh(np.float32(0.7978845608028654) * (gate + 0.044715 * gate**3)))
    else:
        gate = gate / (1 + np.exp(-gate))
    return product(gate * product(h, p + "w_up"), p + "w_down")


def numpy_forward(
    checkpoint: Checkpoint,
    tokens: np.ndarray,
    kernels: bool = False,
    quantized_kv: bool = False,
    states_at: int | None = None,
    final_hidden: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Causal forward of `tokens` from position 0 -> logits [S, V] (`final_hidden`: the final norm's
    output [S, D] in their place), K/V of every layer with a KV
    cache [2 * layers, KV heads, S, head_dim] (K after RoPE), as the cache holds them, and the
    Gated DeltaNet layers' states after the first `states_at` tokens (default: all), as a slot
    holds them and a KV transfer moves them: conv inputs [layers, (K - 1) * channels] and recurrent
    matrices [layers, value_heads * key_dim * value_dim] ([] for a model without such layers). Float32, the
    checkpoint's own dtype: float64 would copy every weight and agrees to ~1e-5 anyway. `kernels`:
    the matrices the checkpoint keeps in their format are multiplied by the CPU kernels' products
    (agent/kernels/calls.py), called directly rather than through a graph: what the check catches,
    a graph that does not fit the weights, it still catches, and it does not dequantize the model
    (the products of every format are held to gguf's dequantization by the kernel tests).
    `quantized_kv`: K and V rounded to q8_0 as a q8_0 cache holds them (cache_format.py). An
    encoder's (ModelSpec.bidirectional) first `states_at` tokens are its prompt, which attend each
    other both ways; the tokens after them attend as a decode step's do, the positions before."""
    spec, t = checkpoint.spec, checkpoint.tensors
    product = partial(_product, checkpoint, kernels)
    n = len(tokens)
    ropes = {}
    for kind in {spec.rope(i) for i in range(spec.num_layers)}:
        inv_freq = np.zeros(spec.rope_dims // 2) if kind == "none" else spec.rope_inv_freq(kind == "local")
        angles = np.concatenate([np.outer(np.arange(n), inv_freq)] * 2, 1)
        ropes[kind] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    distance = np.arange(n)[:, None] - np.arange(n)[None, :]  # query position - key position
    embed = checkpoint.kept("embed") if kernels else None
    if embed is not None:
        from agent.kernels import calls

        x = calls.rows(embed, tokens)
    else:
        x = checkpoint.matrix("embed")[tokens]
    x = x * np.float32(spec.embed_scale)

    def residual(x: np.ndarray, out: np.ndarray, norm: str) -> np.ndarray:  # post-norms: Gemma's
        return x + (_rms_norm(out, t[norm], spec.rms_eps) if spec.post_norms else out)

    caches, convs, recurrents = [], [], []
    for i in range(spec.num_layers):
        p, local = f"layers.{i}.", spec.is_local(i)
        h = _rms_norm(x, t[p + "attn_norm"], spec.rms_eps)
        if spec.is_linear(i):  # no K/V: a state of its own
            mixed, conv, recurrent = _gated_delta(
                h, p, checkpoint, product, n if states_at is None else states_at
            )
            convs.append(conv.reshape(-1))
            recurrents.append(recurrent.reshape(-1))
            x = x + product(mixed, p + "delta_out")
            h = _rms_norm(x, t[p + "ffn_norm"], spec.rms_eps)
            moe = spec.is_moe(i)
            x = x + (
                _experts(h, p, checkpoint, product) if moe else _gated_ffn(h, p, spec.activation, product)
            )
            continue
        if spec.bidirectional:  # an encoder's prompt: every position, within the window either side
            prompt = n if states_at is None else states_at
            later = (distance < 0) & (np.arange(n)[None, :] >= prompt)
            hidden = later | (local & (np.abs(distance) >= spec.sliding_window))
        else:
            hidden = (distance < 0) | (local & (distance >= spec.sliding_window))
        mask = np.where(hidden, -np.inf, 0).astype(np.float32)
        attended, k, v = _attention(h, p, checkpoint, product, ropes[spec.rope(i)], mask, quantized_kv)
        caches += [k, v]
        x = residual(x, product(attended, p + "wo"), p + "post_attn_norm")
        h = _rms_norm(x, t[p + "ffn_norm"], spec.rms_eps)
        if spec.is_moe(i):
            x = x + _experts(h, p, checkpoint, product)
            continue
        x = residual(x, _gated_ffn(h, p, spec.activation, product), p + "post_ffn_norm")
    normed = _rms_norm(x, t["final_norm"], spec.rms_eps)
    states = [np.stack(convs), np.stack(recurrents)] if convs else []
    return normed if final_hidden else head_logits(checkpoint, normed, kernels), np.stack(caches), states


def head_logits(checkpoint: Checkpoint, normed: np.ndarray, kernels: bool = False) -> np.ndarray:
    """The LM head's logits [S, V] of final hidden states [S, D] (numpy_forward's `final_hidden`)."""
    return _product(checkpoint, kernels, normed, "embed" if checkpoint.spec.tied_embeddings else "lm_head")


def _product(checkpoint: Checkpoint, kernels: bool, x: np.ndarray, name: str) -> np.ndarray:
    """x times the checkpoint's matrix `name`: by the CPU kernels' product where it keeps that
    matrix in its format and `kernels` asks for them (numpy_forward), else in float32."""
    kept = checkpoint.kept(name) if kernels else None
    if kept is not None:
        from agent.kernels import calls

        return calls.product(x, kept)
    return x @ checkpoint.matrix(name).T
