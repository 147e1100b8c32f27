// The tiled layout of a KV cache block, used where every read of the cache goes through our
// bfloat16 attention kernels (paged_attention.cpp, prefill_attention.cpp): a block holds 16
// tokens of one KV head, head_dim values each, as the operands vdpbf16ps takes.
//
//   keys:   [head_dim / 2][16 tokens][2]  the two values of a dimension pair, for each token:
//                                         one 64-byte vector per dimension pair, 16 tokens wide
//   values: [8 token pairs][head_dim][2]  the values of two consecutive tokens, for each
//                                         dimension: one 64-byte vector per 16 dimensions
//
// Scores then come out 16 keys to a vector, with no horizontal sums, and the weighted sum of
// values runs on vdpbf16ps over token pairs, as a matrix product. The plain layout,
// [16 tokens][head_dim], is what the torch paths (attention.py) read and write.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace infercloud_kv {

constexpr int64_t kTiledBlock = 16;  // tokens per block in the tiled layout

// Element offsets, within one block, of token `slot`'s value at dimension `d`.
inline int64_t tiled_key_offset(int64_t slot, int64_t d) {
  return ((d / 2) * kTiledBlock + slot) * 2 + (d & 1);
}
inline int64_t tiled_value_offset(int64_t slot, int64_t d, int64_t head_dim) {
  return ((slot / 2) * head_dim + d) * 2 + (slot & 1);
}

// Writes one token's key and value (head_dim each, contiguous) into its slot of a block.
inline void write_tiled(c10::BFloat16* key_block, c10::BFloat16* value_block, int64_t slot,
                        const c10::BFloat16* key, const c10::BFloat16* value, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; d += 2) {
    key_block[tiled_key_offset(slot, d)] = key[d];
    key_block[tiled_key_offset(slot, d) + 1] = key[d + 1];
  }
  c10::BFloat16* v = value_block + tiled_value_offset(slot, 0, head_dim);
  for (int64_t d = 0; d < head_dim; ++d) v[2 * d] = value[d];
}

// Writes a step's keys and values: those of token t, KV head h (at k + t * k_row + h * k_head,
// v likewise, head_dim contiguous each) go to cache row rows[h * tokens + t], i.e. block row
// rows[...] / 16, slot rows[...] % 16. The caller has checked every row.
inline void write_rows_tiled(c10::BFloat16* k_cache, c10::BFloat16* v_cache, const int64_t* rows,
                             int64_t tokens, int64_t heads, int64_t head_dim,
                             const c10::BFloat16* k, int64_t k_row, int64_t k_head,
                             const c10::BFloat16* v, int64_t v_row, int64_t v_head) {
  const int64_t block = kTiledBlock * head_dim;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = rows[h * tokens + t];
      const int64_t base = row / kTiledBlock * block;
      write_tiled(k_cache + base, v_cache + base, row % kTiledBlock, k + t * k_row + h * k_head,
                  v + t * v_row + h * v_head, head_dim);
    }
  }
}

}  // namespace infercloud_kv
