// Decode attention straight from the flat KV cache: for each (sequence, KV head) row n and each of
// its G query heads, softmax(q . K[base[n] .. base[n] + len[n]]) . V over the same rows. It reads
// only the positions a sequence has (no gather copy, no padded attend bucket, no mask).
//
// MindSpore AOT custom-op interface (CPU): inputs q [N, G, hd], k_cache [R, hd], v_cache [R, hd],
// base [N] int32, len [N] int32; output [N, G, hd]; all float32. The attention scale is already in q.
#include <cstdint>

#include "row_ops.h"
#include "usable_cpus.h"

namespace {

constexpr int64_t PARALLEL_ROWS = 8;  // (sequence, KV head) rows from which the team helps

}  // namespace

extern "C" int DecodeAttention(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 6 || ndims[0] != 3) return 1;
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const int32_t *base = static_cast<const int32_t *>(params[3]);
  const int32_t *len = static_cast<const int32_t *>(params[4]);
  float *out = static_cast<float *>(params[5]);
  const int64_t n_rows = shapes[0][0], groups = shapes[0][1], hd = shapes[0][2];

  // Rows over one OpenMP thread per usable CPU once there are enough of them (at 16 sequences x 3
  // KV heads, 17.6 -> ~9 ms a step on 2 cores); a few rows stay on this thread, where waking the
  // team costs more than it saves. The agent sets OMP_WAIT_POLICY=PASSIVE: idle workers sleep.
  static const int threads = usable_cpus();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n_rows >= PARALLEL_ROWS)
  for (int64_t n = 0; n < n_rows; ++n) {
    const int64_t first = static_cast<int64_t>(base[n]) * hd;
    rowwise::attend(q + n * groups * hd, k + first, v + first, len[n], groups, hd, out + n * groups * hd);
  }
  return 0;
}
