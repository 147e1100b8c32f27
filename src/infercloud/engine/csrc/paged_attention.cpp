// Decode attention over the paged KV cache, for the CPU: one query token per sequence reads
// its own request's blocks straight from the pool (no gather into a padded copy), in one pass
// per (sequence, KV head) that serves every query head of the group.
//
// Layout (see attention.py): a layer's cache is [num_kv_heads * num_blocks, block_size, head_dim],
// row `kv_head * num_blocks + block`. block_tables is int32 [num_seqs, max_blocks] (entries past
// a sequence's last block are ignored), context_lens int32 [num_seqs] (>= 1). q is [num_seqs,
// num_heads, head_dim] with each sequence's heads contiguous, its rows any stride apart (a view of
// the fused qkv projection's output is read in place).
//
// Arithmetic: scores, softmax and the weighted sum of values in float32, whatever the cache's
// dtype (float32, bfloat16 or float16); the output has q's dtype.
//
// With `tiled` (bfloat16, blocks of 16, head_dim 32, 64 or 128), the caches are in the tiled
// layout of kv_layout.h: the scores come out 16 keys to a vector with no horizontal sums, and
// the weighted sum runs on vdpbf16ps over token pairs, with the probabilities rounded to
// bfloat16 as the plain-torch path rounds them. 30 layers of 32 sequences at 160 tokens
// (benchmarks/decode_attention_kernel.py, an EPYC): hot 71 -> 51 us per layer, blocks
// scattered over 1 GiB 225 -> 198; inside the engine 130-144 -> 110-116 us per layer.
//
// Registered as torch.ops.infercloud.paged_decode_attention; built and loaded by kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "kv_layout.h"
#include "vec_math.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// Conversions to float32, scalar (any CPU).

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float as_float(c10::Half x) { return static_cast<float>(x); }

// ---------------------------------------------------------------------------------------------
// One (sequence, KV head) task: the `group` query heads that share the KV head attend to its
// `ctx` keys, read block by block through `table`. `scores` holds group * ctx floats.

struct Task {
  const float* q;      // [group, head_dim], already scaled
  const void* q_raw;   // the same rows as they are in q (its dtype, not scaled)
  float scale;
  const int32_t* table;
  int64_t ctx;
  int64_t kv_head;
};

struct Shape {
  int64_t group, head_dim, block_size, num_blocks;
};

#if defined(INFERCLOUD_VEC_LANES)
using namespace infercloud_vec;

// Blocks are scattered over the pool, so the hardware prefetcher, which follows sequential
// streams, stalls at every block boundary. The K pass asks for the key block this many blocks
// ahead and for the value block it will need in the V pass (a task's keys and values, ~40 KB at
// 160 tokens, stay in L2). Measured on 30 layers of 32 sequences at 160 tokens, blocks scattered
// over a 1 GiB pool: 13.5 ms per step without, 6.7 ms with (2, 4 or 8 ahead alike); inside the
// engine 187 -> 126 us per layer.
//
// The prefetches fill L2, not L1 (prefetcht1): a core has few L1 miss buffers, and with one per
// line in flight they, not the memory, capped how fast a task's blocks came in. On a Zen 4
// EPYC (32 GB/s read, 2026-12-08): inside the engine 200-240 -> 140-170 us per layer (the
// decode step's attention 6.1-7.2 -> 4.1-5.1 ms), scattered blocks 425-509 -> 241-301 us per
// layer; with the keys hot, no change. 8 blocks ahead instead of 4 gained nothing.
constexpr int64_t kPrefetchBlocks = 4;

// Where a task's block b starts in one layer's cache, and a prefetch of a whole block.
template <typename T>
struct TaskBlocks {
  const Task& task;
  const Shape& shape;
  int64_t block_stride;  // elements per block
  int64_t used;          // blocks the task reads

  const T* of(const T* base, int64_t b) const {
    return base + (task.kv_head * shape.num_blocks + task.table[b]) * block_stride;
  }
  void prefetch(const T* base, int64_t b) const {
    if (b >= used) return;
    const char* p = reinterpret_cast<const char*>(of(base, b));
    // asm volatile: GCC 12 drops a loop of _mm_prefetch calls behind the bounds check above.
    for (int64_t off = 0; off < block_stride * static_cast<int64_t>(sizeof(T)); off += 64) {
      asm volatile("prefetcht1 %0" : : "m"(*(p + off)));
    }
  }
  // The K pass: fn(first, count, key_block) for each block in turn (its first position, its
  // keys in the context, where it starts), with the key block kPrefetchBlocks ahead and the
  // value block, for the V pass, asked for on the way.
  template <typename Fn>
  void key_pass(const T* k_ptr, const T* v_ptr, Fn fn) const {
    for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch(k_ptr, b);
    for (int64_t b = 0; b < used; ++b) {
      prefetch(k_ptr, b + kPrefetchBlocks);
      prefetch(v_ptr, b);
      const int64_t first = b * shape.block_size;
      fn(first, std::min(shape.block_size, task.ctx - first), of(k_ptr, b));
    }
  }
};

#if defined(__AVX512BF16__)
// Scores of the group's query heads against `count` (<= 16) keys of a bfloat16 block, with
// vdpbf16ps on the unscaled bfloat16 query (the products are exact in float32), scaled after.
template <int ND>
inline void qk_block_bf16(const Task& task, int64_t group, const c10::BFloat16* kb, int64_t count,
                          float* scores, int64_t first) {
  const c10::BFloat16* q = static_cast<const c10::BFloat16*>(task.q_raw);
  const __m512 scale = _mm512_set1_ps(task.scale);
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[ND / 2];
    for (int j = 0; j < ND / 2; ++j) {
      qv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + g * 16 * ND + 32 * j));
    }
    __m512 acc[16];
    for (int64_t t = 0; t < 16; ++t) {
      acc[t] = _mm512_setzero_ps();
      if (t >= count) continue;
      for (int j = 0; j < ND / 2; ++j) {
        const __m512bh kv =
            reinterpret_cast<__m512bh>(_mm512_loadu_si512(kb + t * 16 * ND + 32 * j));
        acc[t] = _mm512_dpbf16_ps(acc[t], qv[j], kv);
      }
    }
    _mm512_mask_storeu_ps(scores + g * task.ctx + first, valid,
                          _mm512_mul_ps(vsum_each(acc), scale));
  }
}
#endif  // __AVX512BF16__

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// Tiled blocks (kv_layout.h), bfloat16, head_dim = 16 * ND. Scores: each key vector (one
// dimension pair of the block's 16 tokens) meets the query heads' broadcast pairs, in several
// partial sums per head so that vdpbf16ps's latency is covered; the 16 lanes are the 16 keys.
// Weighted values: probabilities rounded to bfloat16 (as the plain-torch path's softmax
// outputs them), two tokens per vdpbf16ps against the values' token-pair vectors.

// Scores of HC query heads (raw bfloat16 rows, 16 * ND apart) against `count` keys of a tiled
// block, scaled, into scores[h * ctx + first ..].
template <int ND, int HC>
inline void tiled_scores(const c10::BFloat16* q, float scale, const c10::BFloat16* kb,
                         int64_t count, float* scores, int64_t ctx, int64_t first) {
  constexpr int kPairs = 8 * ND;
  constexpr int kPartials = HC == 3 ? 4 : 8;
  const int32_t* q32[HC];
  for (int h = 0; h < HC; ++h) q32[h] = reinterpret_cast<const int32_t*>(q + h * 16 * ND);
  __m512 acc[HC][kPartials];
  for (int h = 0; h < HC; ++h)
    for (int u = 0; u < kPartials; ++u) acc[h][u] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; p += kPartials) {
    for (int u = 0; u < kPartials; ++u) {
      const __m512bh keys = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kb + (p + u) * 32));
      for (int h = 0; h < HC; ++h) {
        const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(q32[h][p + u]));
        acc[h][u] = _mm512_dpbf16_ps(acc[h][u], pair, keys);
      }
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int h = 0; h < HC; ++h) {
    for (int width = kPartials / 2; width > 0; width /= 2) {
      for (int u = 0; u < width; ++u) acc[h][u] = _mm512_add_ps(acc[h][u], acc[h][u + width]);
    }
    _mm512_mask_storeu_ps(scores + h * ctx + first, valid, _mm512_mul_ps(acc[h][0], scale16));
  }
}

// out rows of HC heads (16 * ND apart) = their bfloat16 probabilities (`probs`: per head,
// `pair_stride` 32-bit token pairs, zero past the context) times the values of the task's blocks.
template <int ND, int HC>
inline void tiled_values(const int32_t* probs, int64_t pair_stride, int64_t ctx,
                         const c10::BFloat16* const* value_blocks, c10::BFloat16* out) {
  constexpr int64_t kHeadDim = 16 * ND;
  __m512 acc[HC][ND];
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < ND; ++j) acc[h][j] = _mm512_setzero_ps();
  const int64_t pairs = (ctx + 1) / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const c10::BFloat16* vp = value_blocks[kp / 8] + (kp % 8) * kHeadDim * 2;
    __m512i v[ND];
    for (int j = 0; j < ND; ++j) v[j] = _mm512_loadu_si512(vp + j * 32);
    if (2 * kp + 1 == ctx) {  // the last token alone: its pair's other slot is not its own
      for (int j = 0; j < ND; ++j) v[j] = _mm512_and_si512(v[j], _mm512_set1_epi32(0xFFFF));
    }
    for (int h = 0; h < HC; ++h) {
      const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(probs[h * pair_stride + kp]));
      for (int j = 0; j < ND; ++j) {
        acc[h][j] = _mm512_dpbf16_ps(acc[h][j], p, reinterpret_cast<__m512bh>(v[j]));
      }
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < ND; ++j) store16(out + h * kHeadDim + 16 * j, acc[h][j]);
}

template <int ND>
void attend_task_tiled(const Task& task, const Shape& shape, const c10::BFloat16* k_ptr,
                       const c10::BFloat16* v_ptr, float* scores, std::vector<int32_t>& probs,
                       std::vector<const c10::BFloat16*>& value_blocks, c10::BFloat16* out) {
  constexpr int64_t kHeadDim = 16 * ND;
  const int64_t group = shape.group, bs = shape.block_size;  // bs == 16
  const int64_t used_blocks = (task.ctx + bs - 1) / bs;
  const TaskBlocks<c10::BFloat16> blocks{task, shape, bs * kHeadDim, used_blocks};
  const c10::BFloat16* q = static_cast<const c10::BFloat16*>(task.q_raw);
  blocks.key_pass(k_ptr, v_ptr, [&](int64_t first, int64_t count, const c10::BFloat16* kb) {
    int64_t h = 0;
    for (; h + 3 <= group; h += 3) {
      tiled_scores<ND, 3>(q + h * kHeadDim, task.scale, kb, count, scores + h * task.ctx, task.ctx,
                          first);
    }
    if (group - h == 2) {
      tiled_scores<ND, 2>(q + h * kHeadDim, task.scale, kb, count, scores + h * task.ctx, task.ctx,
                          first);
    } else if (group - h == 1) {
      tiled_scores<ND, 1>(q + h * kHeadDim, task.scale, kb, count, scores + h * task.ctx, task.ctx,
                          first);
    }
  });
  // Probabilities, normalised and rounded to bfloat16, zero past the context (a whole number
  // of 16-token vectors per head, so that the token pairs read below exist).
  const int64_t padded = (task.ctx + 15) / 16 * 16;
  const int64_t pair_stride = padded / 2;
  probs.resize(group * pair_stride);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * task.ctx;
    const __m512 inv = _mm512_set1_ps(exp_and_inv_sum(s, task.ctx));
    c10::BFloat16* pg = reinterpret_cast<c10::BFloat16*>(probs.data() + g * pair_stride);
    for (int64_t t = 0; t < padded; t += 16) {
      const int64_t n = std::min<int64_t>(16, task.ctx - t);
      const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
      store16(pg + t, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + t), inv));
    }
  }
  value_blocks.resize(used_blocks);
  for (int64_t b = 0; b < used_blocks; ++b) value_blocks[b] = blocks.of(v_ptr, b);
  constexpr int kValueHeads = ND >= 8 ? 2 : 3;  // accumulators: kValueHeads * ND registers
  int64_t h = 0;
  for (; h + kValueHeads <= group; h += kValueHeads) {
    tiled_values<ND, kValueHeads>(probs.data() + h * pair_stride, pair_stride, task.ctx,
                                  value_blocks.data(), out + h * kHeadDim);
  }
  for (; h < group; ++h) {
    tiled_values<ND, 1>(probs.data() + h * pair_stride, pair_stride, task.ctx,
                        value_blocks.data(), out + h * kHeadDim);
  }
}
#endif  // __AVX512BF16__

#if defined(INFERCLOUD_AMX)
// ---------------------------------------------------------------------------------------------
// Tiled blocks on the AMX tile unit (bfloat16, head_dim = 32 * KC, a group of at most 16 query
// heads). On a CPU with the tile unit vdpbf16ps can be slow: one every other cycle on the AMX
// Xeon measured (benchmarks/isa_throughput.cpp), half the rate of float32 FMAs. A tiled block
// already is the tile unit's B operand: its keys, [head_dim / 2][16 tokens][2], are KC tiles of
// 16 dimension pairs by 16 tokens, and its values, [8 token pairs][head_dim][2], are head_dim /
// 16 tiles of 8 token pairs by 16 dimensions (rows head_dim * 4 bytes apart). The query rows of
// the group and their probabilities are the A operands, one row per head.
//
// Tile registers (one configuration per group size):
//   tmm0  A  probabilities of the group for one block's 16 tokens   [group][32 bytes]
//   tmm1  A  32 dimensions of the group's query rows                [group][64 bytes]
//   tmm2  B  16 dimension pairs of a key block                      [16][64 bytes]
//   tmm3  B  8 token pairs of a value block, 16 dimensions          [8][64 bytes]
//   tmm4  C  scores of a block, float32 [group][16]; then, with tmm5..7, the weighted values of
//            up to 64 dimensions, float32 [group][16] each
//
// Scores are the products of the unscaled bfloat16 query and keys, summed in float32 by the
// tile unit and scaled after; the probabilities are rounded to bfloat16 as in the vdpbf16ps
// path. The tile unit flushes denormal inputs to zero. Slots of the last block past the context
// are zeroed in a copy before they meet a probability of zero (their contents are not ours: a
// NaN there would poison the sum).

constexpr int kAmxMaxGroup = 16;

const infercloud_amx::TileConfig& amx_attention_config(int64_t group) {
  static const auto configs = [] {
    std::vector<infercloud_amx::TileConfig> all(kAmxMaxGroup + 1);
    for (int g = 1; g <= kAmxMaxGroup; ++g) {
      infercloud_amx::TileConfig& c = all[g];
      c.set(0, g, 32);
      c.set(1, g, 64);
      c.set(2, 16, 64);
      c.set(3, 8, 64);
      for (int t = 4; t < 8; ++t) c.set(t, g, 64);
    }
    return all;
  }();
  return configs[group];
}

// The weighted values of dimensions [16 * first, 16 * (first + NJ)) over the task's blocks.
template <int NJ>
inline void amx_values(const c10::BFloat16* probs, int64_t padded, int64_t head_dim, int first,
                       const c10::BFloat16* const* value_blocks, int64_t used_blocks,
                       float* out_f32) {
  static_assert(NJ >= 1 && NJ <= 4, "at most four C tiles");
  _tile_zero(4);
  if constexpr (NJ > 1) _tile_zero(5);
  if constexpr (NJ > 2) _tile_zero(6);
  if constexpr (NJ > 3) _tile_zero(7);
  const int64_t value_row = head_dim * 4;  // bytes between token pairs
  for (int64_t b = 0; b < used_blocks; ++b) {
    _tile_loadd(0, probs + b * 16, padded * 2);
    const c10::BFloat16* vb = value_blocks[b] + first * 32;
    // C tile 4 + j += tmm0 . tmm3 (tile numbers are immediates, spelled out)
    _tile_loadd(3, vb, value_row);
    _tile_dpbf16ps(4, 0, 3);
    if constexpr (NJ > 1) {
      _tile_loadd(3, vb + 32, value_row);
      _tile_dpbf16ps(5, 0, 3);
    }
    if constexpr (NJ > 2) {
      _tile_loadd(3, vb + 64, value_row);
      _tile_dpbf16ps(6, 0, 3);
    }
    if constexpr (NJ > 3) {
      _tile_loadd(3, vb + 96, value_row);
      _tile_dpbf16ps(7, 0, 3);
    }
  }
  float* dst = out_f32 + first * 16;
  const int64_t stride = head_dim * 4;
  _tile_stored(4, dst, stride);
  if constexpr (NJ > 1) _tile_stored(5, dst + 16, stride);
  if constexpr (NJ > 2) _tile_stored(6, dst + 32, stride);
  if constexpr (NJ > 3) _tile_stored(7, dst + 48, stride);
}

// Per-thread buffers of the tile path.
struct AmxScratch {
  std::vector<float> scores;                       // [group][padded]
  std::vector<c10::BFloat16> probs;                // [group][padded]
  std::vector<float> out_f32;                      // [group][head_dim]
  std::vector<c10::BFloat16> last_values;          // one value block, slots past ctx zeroed
  std::vector<const c10::BFloat16*> value_blocks;  // where each block's values start
};

template <int KC>
void attend_task_amx(const Task& task, const Shape& shape, const c10::BFloat16* k_ptr,
                     const c10::BFloat16* v_ptr, AmxScratch& scratch, c10::BFloat16* out) {
  constexpr int64_t kHeadDim = 32 * KC;
  const int64_t group = shape.group, bs = shape.block_size;  // bs == 16
  const int64_t used_blocks = (task.ctx + bs - 1) / bs;
  const int64_t padded = used_blocks * bs;
  const TaskBlocks<c10::BFloat16> blocks{task, shape, bs * kHeadDim, used_blocks};
  const c10::BFloat16* q = static_cast<const c10::BFloat16*>(task.q_raw);
  scratch.scores.resize(group * padded);
  float* scores = scratch.scores.data();
  blocks.key_pass(k_ptr, v_ptr, [&](int64_t first, int64_t, const c10::BFloat16* kb) {
    _tile_zero(4);
    for (int c = 0; c < KC; ++c) {
      _tile_loadd(1, q + 32 * c, kHeadDim * 2);
      _tile_loadd(2, kb + c * 512, 64);
      _tile_dpbf16ps(4, 1, 2);
    }
    _tile_stored(4, scores + first, padded * 4);
  });
  // Probabilities: scaled, normalised, rounded to bfloat16, zero past the context.
  scratch.probs.resize(group * padded);
  const __m512 scale = _mm512_set1_ps(task.scale);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    for (int64_t t = 0; t < padded; t += 16) {
      _mm512_storeu_ps(s + t, _mm512_mul_ps(load16(s + t), scale));
    }
    const __m512 inv = _mm512_set1_ps(exp_and_inv_sum(s, task.ctx));
    c10::BFloat16* pg = scratch.probs.data() + g * padded;
    for (int64_t t = 0; t < padded; t += 16) {
      const int64_t n = std::min<int64_t>(16, task.ctx - t);
      const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
      store16(pg + t, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + t), inv));
    }
  }
  scratch.value_blocks.resize(used_blocks);
  for (int64_t b = 0; b < used_blocks; ++b) scratch.value_blocks[b] = blocks.of(v_ptr, b);
  const int64_t last_count = task.ctx - (used_blocks - 1) * bs;
  if (last_count < bs) {
    scratch.last_values.assign(bs * kHeadDim, c10::BFloat16(0.0f));
    const c10::BFloat16* src = scratch.value_blocks[used_blocks - 1];
    c10::BFloat16* dst = scratch.last_values.data();
    for (int64_t p = 0; p < (last_count + 1) / 2; ++p) {
      std::memcpy(dst + p * kHeadDim * 2, src + p * kHeadDim * 2, kHeadDim * 4);
    }
    if (last_count % 2 != 0) {  // the lone last token: its pair's other slot is not its own
      c10::BFloat16* pair = dst + (last_count / 2) * kHeadDim * 2;
      for (int64_t d = 0; d < kHeadDim; ++d) pair[2 * d + 1] = c10::BFloat16(0.0f);
    }
    scratch.value_blocks[used_blocks - 1] = dst;
  }
  scratch.out_f32.resize(group * kHeadDim);
  for (int first = 0; first < 2 * KC; first += 4) {  // 16-dimension tiles, four at a time
    if constexpr (KC == 1) {
      amx_values<2>(scratch.probs.data(), padded, kHeadDim, first, scratch.value_blocks.data(),
                    used_blocks, scratch.out_f32.data());
    } else {
      amx_values<4>(scratch.probs.data(), padded, kHeadDim, first, scratch.value_blocks.data(),
                    used_blocks, scratch.out_f32.data());
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < kHeadDim; d += 16) {
      store16(out + g * kHeadDim + d, load16(scratch.out_f32.data() + g * kHeadDim + d));
    }
  }
}
#endif  // INFERCLOUD_AMX

// head_dim = kLanes * ND, known at compile time so that a row lives in ND registers.
template <typename T, int ND>
void attend_task(const Task& task, const Shape& shape, const T* k_ptr, const T* v_ptr,
                 float* scores, T* out) {
  constexpr int64_t kHeadDim = kLanes * ND;
  const int64_t group = shape.group;
  const int64_t bs = shape.block_size;
  const int64_t used_blocks = (task.ctx + bs - 1) / bs;
  const TaskBlocks<T> blocks{task, shape, bs * kHeadDim, used_blocks};
  blocks.key_pass(k_ptr, v_ptr, [&](int64_t first, int64_t count, const T* kb) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && ND % 2 == 0) {
      if (count <= 16) {
        qk_block_bf16<ND>(task, group, kb, count, scores, first);
        return;
      }
    }
#endif
    for (int64_t t = 0; t < count; ++t) {
      vf k[ND];
      for (int j = 0; j < ND; ++j) k[j] = vload(kb + t * kHeadDim + kLanes * j);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = task.q + g * kHeadDim;
        vf acc = vmul(vload(qg), k[0]);
        for (int j = 1; j < ND; ++j) acc = vfmadd(vload(qg + kLanes * j), k[j], acc);
        scores[g * task.ctx + first + t] = vsum(acc);
      }
    }
  });
  float inv_sum[16];
  for (int64_t g = 0; g < group; ++g) inv_sum[g] = exp_and_inv_sum(scores + g * task.ctx, task.ctx);

  // The weighted sum of values, kHeads query heads at a time: their accumulators and one value
  // row fit the vector registers (32 with AVX-512, 16 with AVX2), so that nothing spills; a
  // task's values stay in L2 between the passes.
  constexpr int kRegisters = kLanes == 16 ? 30 : 15;
  constexpr int kHeads = kRegisters / ND - 1 > 0 ? kRegisters / ND - 1 : 1;
  for (int64_t h0 = 0; h0 < group; h0 += kHeads) {
    const int64_t heads = std::min<int64_t>(kHeads, group - h0);
    vf acc[kHeads][ND];
    for (int h = 0; h < kHeads; ++h)
      for (int j = 0; j < ND; ++j) acc[h][j] = vzero();
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int64_t first = b * bs;
      const int64_t count = std::min(bs, task.ctx - first);
      const T* vb = blocks.of(v_ptr, b);
      for (int64_t t = 0; t < count; ++t) {
        vf v[ND];
        for (int j = 0; j < ND; ++j) v[j] = vload(vb + t * kHeadDim + kLanes * j);
        for (int h = 0; h < heads; ++h) {
          const vf p = vset1(scores[(h0 + h) * task.ctx + first + t]);
          for (int j = 0; j < ND; ++j) acc[h][j] = vfmadd(p, v[j], acc[h][j]);
        }
      }
    }
    for (int h = 0; h < heads; ++h) {
      const vf inv = vset1(inv_sum[h0 + h]);
      T* dst = out + (h0 + h) * kHeadDim;
      for (int j = 0; j < ND; ++j) vstore(dst + kLanes * j, vmul(acc[h][j], inv));
    }
  }
}
#endif  // INFERCLOUD_VEC_LANES

// Any CPU, any head_dim: the same algorithm in scalar loops (the compiler vectorises some).
template <typename T>
void attend_task_generic(const Task& task, const Shape& shape, const T* k_ptr, const T* v_ptr,
                         float* scores, T* out) {
  const int64_t group = shape.group, head_dim = shape.head_dim, bs = shape.block_size;
  const int64_t block_stride = bs * head_dim;
  for (int64_t t = 0; t < task.ctx; ++t) {
    const T* kr = k_ptr + (task.kv_head * shape.num_blocks + task.table[t / bs]) * block_stride +
                  (t % bs) * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) s += task.q[g * head_dim + d] * as_float(kr[d]);
      scores[g * task.ctx + t] = s;
    }
  }
  std::vector<float> acc(group * head_dim, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * task.ctx;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < task.ctx; ++t) peak = std::max(peak, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < task.ctx; ++t) sum += (sg[t] = std::exp(sg[t] - peak));
    for (int64_t t = 0; t < task.ctx; ++t) sg[t] /= sum;
  }
  for (int64_t t = 0; t < task.ctx; ++t) {
    const T* vr = v_ptr + (task.kv_head * shape.num_blocks + task.table[t / bs]) * block_stride +
                  (t % bs) * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * task.ctx + t];
      for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += p * as_float(vr[d]);
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      double scale, int64_t num_blocks, bool tiled, bool tile_unit,
                      at::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0) / num_blocks;
  const Shape shape{num_heads / num_kv_heads, head_dim, k_cache.size(1), num_blocks};
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const int64_t q_row = q.stride(0);  // elements between sequences' query rows
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const float scale_f = static_cast<float>(scale);

  // Split the tasks into one contiguous run per thread of about equal work (keys read).
  const int64_t num_tasks = num_seqs * num_kv_heads;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += lens[s] * num_kv_heads;
  std::vector<int64_t> cuts(parts + 1, num_tasks);
  cuts[0] = 0;
  int64_t done = 0, part = 1;
  for (int64_t task = 0; task < num_tasks && part < parts; ++task) {
    done += lens[task / num_kv_heads];
    while (part < parts && done * parts >= total * part) cuts[part++] = task + 1;
  }

#if defined(INFERCLOUD_AMX)
  const bool amx = std::is_same_v<T, c10::BFloat16> && tiled && tile_unit &&
                   shape.group <= kAmxMaxGroup && infercloud_amx::tiles_available();
#endif
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
#if defined(INFERCLOUD_AMX)
    // Our configuration on this thread (oneDNN's kernels load their own on the same threads).
    if (amx) _tile_loadconfig(&amx_attention_config(shape.group));
    AmxScratch amx_scratch;
#endif
    std::vector<float> qf(shape.group * head_dim);
    std::vector<float> scores;
    std::vector<int32_t> probs;
    std::vector<const c10::BFloat16*> value_blocks;
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t task_id = cuts[p]; task_id < cuts[p + 1]; ++task_id) {
        const int64_t seq = task_id / num_kv_heads;
        const int64_t kv_head = task_id % num_kv_heads;
        const int64_t first_head = kv_head * shape.group;
        const T* q_src = q_ptr + seq * q_row + first_head * head_dim;
        T* dst = out_ptr + (seq * num_heads + first_head) * head_dim;
#if defined(INFERCLOUD_AMX)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (amx) {  // the raw bfloat16 query is the A operand: no float32 copy
            const Task task{nullptr, q_src, scale_f, tables + seq * max_blocks, lens[seq],
                            kv_head};
            if (head_dim == 32) {
              attend_task_amx<1>(task, shape, k_ptr, v_ptr, amx_scratch, dst);
            } else if (head_dim == 64) {
              attend_task_amx<2>(task, shape, k_ptr, v_ptr, amx_scratch, dst);
            } else {
              attend_task_amx<4>(task, shape, k_ptr, v_ptr, amx_scratch, dst);
            }
            continue;
          }
        }
#endif
        // qf: the scaled float32 query, for the paths that read it (the tiled one reads the raw
        // bfloat16 rows and scales the scores; filling qf cost it ~0.1 us a task)
        const Task task{qf.data(), q_src, scale_f, tables + seq * max_blocks, lens[seq], kv_head};
        scores.resize(shape.group * task.ctx);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (tiled) {  // checked by the caller: bfloat16, 16-token blocks, head_dim 32/64/128
            if (head_dim == 32) {
              attend_task_tiled<2>(task, shape, k_ptr, v_ptr, scores.data(), probs, value_blocks,
                                   dst);
            } else if (head_dim == 64) {
              attend_task_tiled<4>(task, shape, k_ptr, v_ptr, scores.data(), probs, value_blocks,
                                   dst);
            } else {
              attend_task_tiled<8>(task, shape, k_ptr, v_ptr, scores.data(), probs, value_blocks,
                                   dst);
            }
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < shape.group * head_dim; ++i) qf[i] = as_float(q_src[i]) * scale_f;
#if defined(INFERCLOUD_VEC_LANES)
        if (shape.group <= 16 && head_dim == 64) {
          attend_task<T, 64 / kLanes>(task, shape, k_ptr, v_ptr, scores.data(), dst);
          continue;
        }
        if (shape.group <= 16 && head_dim == 128) {
          attend_task<T, 128 / kLanes>(task, shape, k_ptr, v_ptr, scores.data(), dst);
          continue;
        }
#endif
        attend_task_generic<T>(task, shape, k_ptr, v_ptr, scores.data(), dst);
      }
    }
#if defined(INFERCLOUD_AMX)
    if (amx) _tile_release();
#endif
  });
}

// Whether this build reads tiled caches (kv_layout.h): it needs AVX512-BF16.
bool has_tiled_decode() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Whether `tile_unit=True` runs the tiled path on the AMX tile unit here (else it is ignored).
bool has_attention_tiles() { return infercloud_amx::tiles_available(); }

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t num_blocks, bool tiled, bool tile_unit) {
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "caches must be [num_kv_heads * num_blocks, block_size, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "q's heads must be contiguous within each sequence's row");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(2) == q.size(2), "head_dim of q and the caches differ");
  TORCH_CHECK(num_blocks > 0 && k_cache.size(0) % num_blocks == 0,
              "cache rows are not a multiple of num_blocks");
  const int64_t num_kv_heads = k_cache.size(0) / num_blocks;
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "num_heads is not a multiple of num_kv_heads");
  TORCH_CHECK(!tiled || (has_tiled_decode() && q.scalar_type() == at::kBFloat16 &&
                         k_cache.size(1) == infercloud_kv::kTiledBlock &&
                         (q.size(2) == 32 || q.size(2) == 64 || q.size(2) == 128)),
              "tiled caches need AVX512-BF16, bfloat16, blocks of 16 and head_dim 32, 64 or 128");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous [num_seqs, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) &&
                  context_lens.is_contiguous(),
              "context_lens must be contiguous [num_seqs]");
  {
    // Every read stays inside the pool: contexts >= 1 and covered by the table, whose used
    // entries lie in [0, num_blocks).
    const int64_t block_size = k_cache.size(1);
    const int64_t max_blocks = block_tables.size(1);
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    for (int64_t s = 0; s < q.size(0); ++s) {
      TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "context ", lens[s],
                  " of sequence ", s, " is not in [1, ", max_blocks * block_size, "]");
      const int64_t used = (lens[s] + block_size - 1) / block_size;
      for (int64_t b = 0; b < used; ++b) {
        const int32_t block = tables[s * max_blocks + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is not in [0, ",
                    num_blocks, ")");
      }
    }
  }
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_attention<float>(q, k_cache, v_cache, block_tables, context_lens, scale, num_blocks,
                              tiled, tile_unit, out);
      break;
    case at::kBFloat16:
      decode_attention<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      num_blocks, tiled, tile_unit, out);
      break;
    case at::kHalf:
      decode_attention<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, scale,
                                  num_blocks, tiled, tile_unit, out);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(infercloud, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int num_blocks, bool tiled=False, bool tile_unit=False) "
      "-> Tensor");
  m.def("has_tiled_decode() -> bool", &has_tiled_decode);
  m.def("has_attention_tiles() -> bool", &has_attention_tiles);
}

TORCH_LIBRARY_IMPL(infercloud, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
