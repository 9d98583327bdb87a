// Attention of a prompt chunk's rows (consecutive rows of one sequence, each attending its positions
// 0..len-1 through the sequence's block table) as two products per KV head: the scores of a block of
// query rows against every key, then their softmax against every value, each through the packed
// product (packed_matmul.h) over keys and values copied once into its tile layout. Row by row
// (row_ops.h attend_paged), every query row reads all its keys and values again: a 128-row chunk
// after 1,000 cached positions spent 5 ms a layer there, about as long as its four weight products.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "packed_matmul.h"
#include "row_ops.h"

namespace prompt_attention {

using packed::TILE;

constexpr int64_t MIN_ROWS = 8;     // shorter runs (decode rows: one each) go row by row
// Query rows a work item takes (x 3 heads' groups = 24 vectors): as fast a row as 16 (a block attends
// its longest row's width, so less is wasted), and a 16-row chunk is 6 items for the 2 threads, not 3.
constexpr int64_t BLOCK_ROWS = 8;

inline int64_t tiles_of(int64_t n) { return (n + TILE - 1) / TILE; }

// One run of rows [first, first + rows) sharing a block table, and its keys and values per KV head in
// the packed layout: positions lowest .. length - 1, keys as [tiles_of(length - lowest), hd, TILE]
// (the scores' weights), values as [hd / TILE, padded, TILE] (the output's); positions past `length`
// are zeros. `lowest` is 0 but in a sliding-window layer: the first position any row attends.
struct Run {
  int64_t first, rows, length;  // length: the most positions any of its rows and KV heads attends
  int64_t lowest = 0;
  float *keys = nullptr, *values = nullptr;  // per KV head, one after the other (padded() * hd each)

  int64_t padded() const { return tiles_of(length - lowest) * TILE; }
};

// The first position a row attending `len` positions reads (a sliding window of `window`; 0: none).
inline int64_t first_attended(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Maximal runs of at least MIN_ROWS consecutive live rows with the same table; `len` is per (row,
// KV head), row-major. A run's length is the longest of every row and KV head: the packed keys and
// values it sizes must hold each head's positions, whichever head attends furthest (and, in a
// sliding-window layer, from the earliest any attends).
inline std::vector<Run> find_runs(const int32_t *row_table, const int32_t *len, int64_t live, int64_t kv,
                                  int64_t window = 0) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < live;) {
    int64_t e = b + 1;
    while (e < live && row_table[e] == row_table[b]) ++e;
    if (e - b >= MIN_ROWS) {
      const int64_t longest = *std::max_element(len + b * kv, len + e * kv);
      const int64_t shortest = *std::min_element(len + b * kv, len + e * kv);
      runs.push_back(Run{b, e - b, longest, first_attended(shortest, window)});
    }
    b = e;
  }
  return runs;
}

// Copies positions lowest + [32 t, 32 t + 32) of KV head `head` into the run's packed keys and values.
inline void pack_tile(const Run &run, const float *k_cache, const float *v_cache, const rowwise::Paged &at,
                      int64_t hd, int64_t t) {
  const int64_t padded = run.padded();
  float *keys = run.keys + at.head * padded * hd + t * hd * TILE;
  float *values = run.values + at.head * padded * hd;
  for (int64_t i = 0; i < TILE; ++i) {
    const int64_t p = run.lowest + t * TILE + i;
    const bool real = p < run.length;
    const int64_t row = real ? (static_cast<int64_t>(at.table[p / at.block]) * at.kv + at.head) * at.block +
                                   p % at.block
                             : 0;
    const float *key = k_cache + row * hd, *value = v_cache + row * hd;
    for (int64_t d = 0; d < hd; ++d) keys[d * TILE + i] = real ? key[d] : 0.f;
    for (int64_t c = 0; c < hd / TILE; ++c)
      for (int64_t d = 0; d < TILE; ++d)
        values[(c * padded + t * TILE + i) * TILE + d] = real ? value[c * TILE + d] : 0.f;
  }
}

// Rows [b0, b1) of a run, KV head `head`: their query vectors q [N * KV * groups, hd] (row b's for
// head h at (b * KV + h) * groups) -> out, the same layout. Softmax over each row's own positions:
// first_attended(len, window) .. len - 1.
inline void attend_block(const Run &run, const float *q, const int32_t *len, int64_t kv, int64_t groups,
                         int64_t hd, int64_t head, int64_t b0, int64_t b1, int64_t window, float *out) {
  const int64_t vectors = (b1 - b0) * groups, padded = run.padded();
  int64_t longest = 0;  // of this head, packed: its softmax runs over positions up to len of each row
  for (int64_t b = b0; b < b1; ++b) longest = std::max<int64_t>(longest, len[b * kv + head] - run.lowest);
  const int64_t width = tiles_of(longest) * TILE;  // key positions these rows reach
  thread_local std::vector<float> queries, scores, result;
  queries.resize(vectors * hd);
  scores.resize(vectors * width);
  result.resize(vectors * hd);
  for (int64_t b = b0; b < b1; ++b)
    std::copy_n(q + (b * kv + head) * groups * hd, groups * hd, queries.data() + (b - b0) * groups * hd);
  const float *keys = run.keys + head * padded * hd;
  const float *values = run.values + head * padded * hd;
  for (int64_t j = 0; j < width / TILE; ++j)
    packed::tile(queries.data(), keys, nullptr, scores.data(), vectors, hd, width, j);
  for (int64_t v = 0; v < vectors; ++v) {
    float *s = scores.data() + v * width;
    const int64_t length = len[(b0 + v / groups) * kv + head];
    const int64_t n = length - run.lowest, from = first_attended(length, window) - run.lowest;
    rowwise::softmax(s + from, n - from);
    std::fill(s, s + from, 0.f);
    std::fill(s + n, s + width, 0.f);
  }
  for (int64_t c = 0; c < hd / TILE; ++c)  // values' column tile c: its own [padded, TILE] stream
    packed::tile(scores.data(), values + c * padded * TILE, nullptr, result.data() + c * TILE, vectors, width,
                 hd, 0);
  for (int64_t b = b0; b < b1; ++b)
    std::copy_n(result.data() + (b - b0) * groups * hd, groups * hd, out + (b * kv + head) * groups * hd);
}

}  // namespace prompt_attention
