// Gated DeltaNet, the linear attention of Qwen3.5's hybrid layers (three of every four), one
// sequence's rows at a time, for fused_layer.cc. Per token t of a sequence:
//   y = silu(causal depthwise conv of the last K inputs x (the QKV product's row), channel by channel)
//   q, k (key_heads heads of key_dim), v (value_heads heads of value_dim) = the parts of y; q and k
//   L2-normalised per head, q scaled by 1 / sqrt(key_dim); value head h reads key head h % key_heads
//   (the tiled order llama.cpp's converter writes; the HF loader reorders to it)
//   beta = sigmoid(b_h), decay = exp(A_h * softplus(a_h + dt_bias_h))   (A = -exp(A_log) < 0)
//   S_h = decay * S_h;  S_h += k (beta (v_h - S_h^T k))^T;  o_h = S_h^T q        (S_h [key_dim, value_dim])
//   out_h = rms_norm(o_h) * norm * silu(z_h)
// The state a sequence carries from one call to the next is fixed in size: the last K - 1 inputs of
// the conv, and S of each value head (float32). A sequence whose first row of a call is its
// position 0 starts from zeros; a later one goes on from the state its slot holds.
//
// Speculative decoding verifies proposals whose state no step may keep before the sampler has
// chosen: such rows run on a copy of the state ("held"), their inputs (the conv's, b and a) kept
// beside the slot, and the next call first replays the rows that were accepted onto the slot's
// state (the recurrence alone: no product is computed again). A prompt's state may be saved into a
// snapshot slot at a block boundary and restored from it into another sequence's slot (a prefix
// cache hit on a hybrid model).
//
// Prompts run the same token-by-token recurrence as decode steps: on a CPU each token costs
// value_heads * key_dim * value_dim * 6 flops, a few percent of its layer's products (the chunked
// form exists for a GPU's matrix units), and the state of a head stays in L2 across a prompt.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_ops.h"
#include "vec8.h"

namespace gated_delta {

struct Shape {
  int64_t key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0, conv_kernel = 0;

  int64_t key_width() const { return key_heads * key_dim; }
  int64_t value_width() const { return value_heads * value_dim; }
  int64_t channels() const { return 2 * key_width() + value_width(); }  // the conv's: q, k, v
  int64_t conv_state() const { return (conv_kernel - 1) * channels(); }
  int64_t head_state() const { return key_dim * value_dim; }
  int64_t recurrent_state() const { return value_heads * head_state(); }
};

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold

// Channels [c0, c1) of `rows` consecutive inputs x (row r at in + r * in_stride) through the causal
// conv (weight [K, channels]: tap j of every channel, then tap j + 1; tap K - 1 takes the current
// input) and silu into out (row r at out + r * out_stride); `state` [K - 1, channels] holds the
// inputs before the first row (oldest first; zeros where `fresh`) and, where `keep`, is left holding
// the last K - 1 inputs. Eight channels at a time (exp8's silu): channels are independent.
inline void convolve(const Shape &shape, const float *weight, float *state, bool fresh, bool keep, const float *in,
                     int64_t in_stride, int64_t rows, float *out, int64_t out_stride, int64_t c0, int64_t c1) {
  const int64_t kernel = shape.conv_kernel, channels = shape.channels(), held = kernel - 1;
  thread_local std::vector<float> zeros;
  const float *before = state;  // the inputs before the run's first
  if (fresh) {
    zeros.assign(held * channels, 0.f);
    before = zeros.data();
  }
  // input t of the run (t < 0: the earlier inputs' row held + t), at channel c
  auto input = [&](int64_t t, int64_t c) -> const float * {
    return t >= 0 ? in + t * in_stride + c : before + (held + t) * channels + c;
  };
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8)
    for (int64_t r = 0; r < rows; ++r) {
      vec8::v8f sum = vec8::load(weight + c) * vec8::load(input(r - held, c));
      for (int64_t j = 1; j < kernel; ++j)
        sum += vec8::load(weight + j * channels + c) * vec8::load(input(r - held + j, c));
      const vec8::v8f y = sum / (1.f + rowwise::exp8(-sum));
      std::memcpy(out + r * out_stride + c, &y, sizeof y);
    }
  for (; c < c1; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t j = 0; j < kernel; ++j) sum += weight[j * channels + c] * *input(r - held + j, c);
      out[r * out_stride + c] = silu(sum);
    }
  if (!keep) return;
  // the last `held` inputs; row i reads input rows - held + i, an earlier state row not yet written
  for (int64_t i = 0; i < held; ++i)
    std::memmove(state + i * channels + c0, input(rows - held + i, c0), sizeof(float) * (c1 - c0));
}

// x / sqrt(sum(x^2) + 1e-6), FLA's (and transformers') L2 norm of q and k.
inline void l2_normalise(const float *x, int64_t n, float scale, float *out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float by = scale / std::sqrt(squares + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * by;
}

// What one value head reads of a sequence's rows.
struct HeadInputs {
  const float *conv;  // the first row's conv output (q, k, v); rows `conv_stride` apart
  const float *z;     // the first row's z [value_width] (none: no output); rows `gate_stride` apart, as ba's
  const float *ba;    // the first row's b [value_heads], then a [value_heads]
  int64_t conv_stride, gate_stride;
  const float *dt_bias, *a_log_neg, *norm;  // [value_heads], A = -exp(A_log) [value_heads], [value_dim]
  float eps;
};

// Value head h of `rows` consecutive rows: the recurrence from `state` [key_dim, value_dim] (zeros
// where `fresh`), left in it; each row's gated, normed output into out (row r at out + r * out_stride
// + h * value_dim) where the inputs have z (a replay computes none).
inline void recur(const Shape &shape, const HeadInputs &in, int64_t h, float *state, bool fresh, int64_t rows,
                  float *out, int64_t out_stride) {
  const int64_t dk = shape.key_dim, dv = shape.value_dim, kh = h % shape.key_heads;
  constexpr int64_t MAX_DIM = 512;
  float q[MAX_DIM], k[MAX_DIM], mem[MAX_DIM], o[MAX_DIM];
  if (fresh) std::memset(state, 0, sizeof(float) * dk * dv);
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int64_t r = 0; r < rows; ++r) {
    const float *y = in.conv + r * in.conv_stride, *ba = in.ba + r * in.gate_stride;
    l2_normalise(y + kh * dk, dk, q_scale, q);
    l2_normalise(y + shape.key_width() + kh * dk, dk, 1.f, k);
    const float *v = y + 2 * shape.key_width() + h * dv;
    const float b = ba[h], a = ba[shape.value_heads + h];
    const float beta = 1.f / (1.f + std::exp(-b));
    const float decay = std::exp(in.a_log_neg[h] * softplus(a + in.dt_bias[h]));
    std::memset(mem, 0, sizeof(float) * dv);
    for (int64_t i = 0; i < dk; ++i) {  // S *= decay; mem = S^T k
      float *s = state + i * dv;
      const float ki = k[i];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        s[j] *= decay;
        mem[j] += s[j] * ki;
      }
    }
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) mem[j] = (v[j] - mem[j]) * beta;  // the delta
    std::memset(o, 0, sizeof(float) * dv);
    for (int64_t i = 0; i < dk; ++i) {  // S += k delta^T; o = S^T q
      float *s = state + i * dv;
      const float ki = k[i], qi = q[i];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        s[j] += ki * mem[j];
        o[j] += s[j] * qi;
      }
    }
    if (in.z == nullptr) continue;
    float *to = out + r * out_stride + h * dv;
    rowwise::rms_norm(o, in.norm, in.eps, dv, to);
    const float *z = in.z + r * in.gate_stride + h * dv;
    for (int64_t j = 0; j < dv; ++j) to[j] *= silu(z[j]);
  }
}

}  // namespace gated_delta
