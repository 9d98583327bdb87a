// Decode attention straight from the paged KV cache: for each (sequence, KV head) row n and each of
// its G query heads, softmax(q . K) . V over the sequence's positions 0 .. len[n] - 1, read block by
// block through its block table. It reads only the positions a sequence has (no gather copy, no
// padded attend bucket, no mask).
//
// MindSpore AOT custom-op interface (CPU): inputs q [N, G, hd], k_cache [R, hd], v_cache [R, hd]
// (or uint8 [R, hd / 32 * 34]: a q8_0 cache, kv_rows.h), tables [rows, MB] int32 (row b's block
// table; N = rows * KV, n = b * KV + head), block_size [1] int32 (B), len [N] int32; output [N, G, hd];
// all float32 unless said. The cache is paged as in fused_layer.cc: position p of head h is row
// (table[p / B] * KV + h) * B + p % B, R = blocks * KV * B.
// The attention scale is already in q. A call whose tables or len would read outside the cache is
// refused (returns 1); the host checks them first (agent/graph_interface.py).
#include <cstdint>

#include "entry.h"
#include "row_ops.h"
#include "thread_team.h"

namespace {

constexpr int64_t PARALLEL_ROWS = 8;  // (sequence, KV head) rows from which the team helps

}  // namespace

KERNEL_ENTRY int DecodeAttention(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 7 || ndims[0] != 3 || ndims[1] != 2 || ndims[3] != 2 || ndims[4] != 1 || ndims[5] != 1)
    return 1;
  const float *q = static_cast<const float *>(params[0]);
  const int32_t *tables = static_cast<const int32_t *>(params[3]);
  const int64_t block = *static_cast<const int32_t *>(params[4]);
  const int32_t *len = static_cast<const int32_t *>(params[5]);
  float *out = static_cast<float *>(params[6]);
  const int64_t n_rows = shapes[0][0], groups = shapes[0][1], hd = shapes[0][2];
  const int64_t rows = shapes[3][0], entries = shapes[3][1], cache_rows = shapes[1][0];
  kvrows::Cache k, v;
  if (rows <= 0 || n_rows % rows != 0 || shapes[5][0] != n_rows || shapes[4][0] != 1 || block <= 0 ||
      shapes[2][0] != cache_rows || shapes[2][1] != shapes[1][1] || !kvrows::Cache::of(params[1], shapes[1][1], hd, k) ||
      !kvrows::Cache::of(params[2], shapes[2][1], hd, v))
    return 1;
  const int64_t kv = n_rows / rows;
  if (kv <= 0 || cache_rows % (kv * block) != 0) return 1;
  const int64_t blocks = cache_rows / (kv * block);
  for (int64_t n = 0; n < n_rows; ++n)
    if (!rowwise::table_covers(tables + (n / kv) * entries, entries, block, len[n], blocks)) return 1;

  // Rows over the kernels' thread team once there are enough of them (at 16 sequences x 3 KV heads,
  // 17.6 -> ~9 ms a step on 2 cores); a few rows stay on this thread, where waking the team costs
  // more than it saves.
  auto attend = [&](int64_t n) {
    const rowwise::Paged at{tables + (n / kv) * entries, kv, block, n % kv};
    rowwise::attend_paged(q + n * groups * hd, k, v, at, len[n], groups, hd, out + n * groups * hd);
  };
  if (n_rows < PARALLEL_ROWS) {
    const team::FlushDenormals flush;  // as the team's threads do
    for (int64_t n = 0; n < n_rows; ++n) attend(n);
  } else {
    team::Team::instance().run([&](team::Region &region) { region.for_dynamic(n_rows, 1, attend); });
  }
  return 0;
}
