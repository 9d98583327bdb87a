// Attention of a step's rows in work items: consecutive rows sharing a block table (a prompt chunk's,
// a decode row with its proposals) in blocks of up to BLOCK_ROWS, one KV head each, through
// row_ops.h attend_paged_rows. A block's rows share each cache block's key and value loads (row by
// row, every row of a 128-row chunk after 1,000 cached positions read all its keys again), while
// each row's arithmetic stays that of a row alone: a prompt's answer does not depend on how it is
// chunked, on a prefix-cache hit, or on the rows beside it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "row_ops.h"

namespace prompt_attention {

// Rows a work item takes: a 16-row chunk is 2 x KV heads items for the 2 threads.
constexpr int64_t BLOCK_ROWS = 8;

// Rows [b0, b1) sharing a block table, KV head `head`, its query heads [g0, g1); `last`: the last row
// of their run (the sequence's last position in the call, which a bidirectional layer's rows attend).
struct Block {
  int64_t head, b0, b1, g0, g1, last;
};

// The first position a row attending `len` positions reads (a sliding window of `window`; 0: none).
inline int64_t first_attended(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// A bidirectional layer's row (an encoder's, EmbeddingGemma's) at position len - 1 attends every
// position of its sequence in the call, 0 .. run_len - 1 (a whole prompt: such models are never
// chunked), within `window` - 1 positions either side where the layer has a window (transformers'
// |i - j| < window, llama.cpp's symmetric sliding window of 2 (window - 1)): [first, end).
inline void bidirectional_span(int64_t len, int64_t run_len, int64_t window, int64_t &first, int64_t &end) {
  const int64_t position = len - 1;
  first = window > 0 ? std::max<int64_t>(0, position - (window - 1)) : 0;
  end = window > 0 ? std::min(run_len, position + window) : run_len;
}

// The work items of `live` rows: each maximal run of consecutive rows with the same table, in
// blocks of up to BLOCK_ROWS rows, per KV head. Fewer items than twice the threads leave threads
// idle (one sequence's 3 KV heads on 2 threads: one does 2), so an item of several rows (a decode
// row and its proposals: their products bound it, not memory) is then split in two halves of its
// query heads, which read the same keys and values: a step of the default model verifying 4
// proposals at context 1000, 15.3 -> 14.1 ms (2-core Xeon). A row alone is left whole: reading its
// keys and values twice cost more than the idle thread. A query vector's arithmetic is the same in
// any split (row_ops.h attend_rows).
inline std::vector<Block> find_blocks(const int32_t *row_table, int64_t live, int64_t kv, int64_t groups,
                                      int64_t threads) {
  std::vector<Block> blocks;
  for (int64_t b = 0; b < live;) {
    int64_t e = b + 1;
    while (e < live && row_table[e] == row_table[b]) ++e;
    for (int64_t b0 = b; b0 < e; b0 += BLOCK_ROWS)
      for (int64_t head = 0; head < kv; ++head)
        blocks.push_back({head, b0, std::min(b0 + BLOCK_ROWS, e), 0, groups, e - 1});
    b = e;
  }
  if (groups > 1 && static_cast<int64_t>(blocks.size()) < 2 * threads && blocks.size() % threads != 0) {
    std::vector<Block> halves;
    for (const Block &w : blocks) {
      if (w.b1 - w.b0 == 1) {
        halves.push_back(w);
        continue;
      }
      halves.push_back({w.head, w.b0, w.b1, 0, groups / 2, w.last});
      halves.push_back({w.head, w.b0, w.b1, groups / 2, groups, w.last});
    }
    blocks.swap(halves);
  }
  return blocks;
}

// A block's rows: their query vectors q [N * KV * groups, hd] (row b's for head h at
// (b * KV + h) * groups) -> out, the same layout; each row over its own positions
// first_attended(len, window) .. len - 1 (len per (row, KV head), row-major), or in a bidirectional
// layer its bidirectional_span.
inline void attend_block(const Block &w, const rowwise::Paged &at, const kvrows::Cache &k_cache,
                         const kvrows::Cache &v_cache,
                         const float *q, const int32_t *len, int64_t kv, int64_t groups, int64_t hd,
                         int64_t window, bool bidirectional, float *out) {
  int64_t length[BLOCK_ROWS], first[BLOCK_ROWS];
  const int64_t run_len = len[w.last * kv + w.head];
  for (int64_t b = w.b0; b < w.b1; ++b) {
    const int64_t own = len[b * kv + w.head];
    if (bidirectional)
      bidirectional_span(own, run_len, window, first[b - w.b0], length[b - w.b0]);
    else
      length[b - w.b0] = own, first[b - w.b0] = first_attended(own, window);
  }
  const int64_t at_row = (w.b0 * kv + w.head) * groups * hd + w.g0 * hd;
  rowwise::attend_paged_rows(q + at_row, k_cache, v_cache, at, length, first, w.b1 - w.b0, kv * groups * hd,
                             w.g1 - w.g0, hd, out + at_row);
}

}  // namespace prompt_attention
