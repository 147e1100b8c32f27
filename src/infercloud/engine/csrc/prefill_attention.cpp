// Causal attention of prefill chunks over the paged KV cache, bfloat16, for CPUs with
// AVX512-BF16: the scores and the weighted sum of values as two small matrix products with
// vdpbf16ps (bf16_dot.h), no gather into a padded copy, no mask tensor.
//
// A chunk is `len` query tokens at positions start .. start + len - 1 of one request, whose
// keys and values (those of the chunk included, already written) sit in the blocks of its
// table row. Per (chunk, KV head): the keys are packed once as 16-key column tiles (K^T) and
// the values as 16-dimension tiles (V^T, key pairs along k), then every block of 8 query rows
// (token-major, the group's query heads adjacent) computes float32 scores against the keys up
// to its last row's position, scales them, masks the future, takes a float32 softmax, rounds
// the probabilities to bfloat16 (as the plain-torch path, whose softmax outputs bfloat16) and
// multiplies them with the values; the output is rounded to bfloat16 once.
//
// float32 (AVX2 or AVX-512, f32_gemm.h): the same two products on float32 tiles. Per (chunk, KV
// head) the keys are packed as K^T column tiles of kLanes keys and the values as tiles of kLanes
// dimensions; every block of kMR query rows computes its scores with the float32 GEMM kernel,
// scales them, masks the future, takes the softmax and multiplies it with the values; nothing is
// rounded below float32.
//
// Registered as torch.ops.infercloud.paged_prefill_attention; built and loaded by
// cpu_kernels.py; bfloat16 needs AVX512-BF16 and float32 a vector path (AVX2 or AVX-512): it
// refuses otherwise (the engine then keeps the torch path).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "amx.h"
#include "f32_gemm.h"
#include "vec_math.h"
#if defined(__AVX512BF16__)
#include "bf16_dot.h"
#include "kv_layout.h"
#endif

namespace {

struct Chunk {
  int64_t row_start, start, len;  // first row in q, first position, tokens
  const int32_t* table;
};

// Every (chunk, KV head) task's keys and values, packed into two arrays at the tasks' offsets.
template <typename T>
struct PackedTasks {
  std::vector<int64_t> k_off, v_off;
  std::unique_ptr<T[]> k, v;
  const T* keys(int64_t task) const { return k.get() + k_off[task]; }
  const T* values(int64_t task) const { return v.get() + v_off[task]; }
};

// `sizes(ctx)`: the {key, value} elements a task of `ctx` keys packs into; `pack(chunk, kv_head,
// keys, values)` writes every one of them (the arrays are not initialised). Tasks run in
// parallel.
template <typename T, typename Sizes, typename Pack>
PackedTasks<T> pack_tasks(const std::vector<Chunk>& chunks, int64_t num_kv_heads, Sizes sizes,
                          Pack pack) {
  const int64_t tasks = static_cast<int64_t>(chunks.size()) * num_kv_heads;
  PackedTasks<T> packed{std::vector<int64_t>(tasks + 1, 0), std::vector<int64_t>(tasks + 1, 0),
                        nullptr, nullptr};
  for (int64_t i = 0; i < tasks; ++i) {
    const Chunk& ch = chunks[i / num_kv_heads];
    const auto [k_size, v_size] = sizes(ch.start + ch.len);
    packed.k_off[i + 1] = packed.k_off[i] + k_size;
    packed.v_off[i + 1] = packed.v_off[i] + v_size;
  }
  packed.k.reset(new T[packed.k_off[tasks]]);
  packed.v.reset(new T[packed.v_off[tasks]]);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      pack(chunks[i / num_kv_heads], i % num_kv_heads, packed.k.get() + packed.k_off[i],
           packed.v.get() + packed.v_off[i]);
    }
  });
  return packed;
}

// The query rows of every task in blocks of up to kRowsMax (token-major, the group's heads
// adjacent, so in position order), in parallel: each block's rows are copied out of q,
// `attend(scratch, count, q_rows, positions, task, ctx, o_rows)` fills o_rows, and those go to
// `out` at the same places. `Scratch` is per thread.
template <typename T, int kRowsMax, typename Scratch, typename Attend>
void for_each_row_block(const T* q, T* out, const std::vector<Chunk>& chunks,
                        int64_t num_kv_heads, int64_t num_heads, int64_t head_dim,
                        Attend attend) {
  struct Unit {
    int64_t task, first_row, count;
  };
  const int64_t group = num_heads / num_kv_heads;
  std::vector<Unit> units;
  for (int64_t i = 0; i < static_cast<int64_t>(chunks.size()) * num_kv_heads; ++i) {
    const int64_t task_rows = chunks[i / num_kv_heads].len * group;
    for (int64_t r = 0; r < task_rows; r += kRowsMax) {
      units.push_back({i, r, std::min<int64_t>(kRowsMax, task_rows - r)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    alignas(64) T q_rows[kRowsMax * 256];
    alignas(64) T o_rows[kRowsMax * 256];
    int64_t positions[kRowsMax];
    for (int64_t u = begin; u < end; ++u) {
      const Unit& unit = units[u];
      const Chunk& ch = chunks[unit.task / num_kv_heads];
      const int64_t kv_head = unit.task % num_kv_heads;
      auto offset = [&](int64_t m) {  // where row m of the block lives in q and out
        const int64_t r = unit.first_row + m, token = r / group, head = kv_head * group + r % group;
        return ((ch.row_start + token) * num_heads + head) * head_dim;
      };
      for (int64_t m = 0; m < unit.count; ++m) {
        positions[m] = ch.start + (unit.first_row + m) / group;
        std::copy_n(q + offset(m), head_dim, q_rows + m * head_dim);
      }
      attend(scratch, unit.count, q_rows, positions, unit.task, ch.start + ch.len, o_rows);
      for (int64_t m = 0; m < unit.count; ++m) {
        std::copy_n(o_rows + m * head_dim, head_dim, out + offset(m));
      }
    }
  });
}

#if defined(__AVX512BF16__)
using Bf16 = c10::BFloat16;
constexpr int kRows = 8;  // query rows per block

// Zeroes the rows [key_pairs, pair_stride) of every V^T tile (the tile path reads whole tiles of
// 16 key pairs; a zero probability times a zero value adds nothing).
void zero_pair_padding(Bf16* v_tiles, int64_t key_pairs, int64_t pair_stride, int64_t head_dim) {
  if (key_pairs == pair_stride) return;
  for (int64_t d = 0; d < head_dim; d += 16) {
    std::fill(v_tiles + (d / 16) * pair_stride * 32 + key_pairs * 32,
              v_tiles + (d / 16 + 1) * pair_stride * 32, Bf16(0.0f));
  }
}

// Packs this (chunk, head)'s `ctx` keys as K^T tiles [ceil(ctx/16)][head_dim/2][16][2] and values
// as V^T tiles [head_dim/16][pair_stride][16][2] (pair_stride >= ceil(ctx/2)); padding is zero.
void pack_kv(const Bf16* k_cache, const Bf16* v_cache, const int32_t* table, int64_t ctx,
             int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t head_dim,
             int64_t pair_stride, Bf16* k_tiles, Bf16* v_tiles) {
  const int64_t dim_pairs = head_dim / 2;
  const int64_t key_pairs = (ctx + 1) / 2;
  if (ctx % 16 != 0) {  // the last key tile's unused columns: zero (full tiles are overwritten)
    std::fill(k_tiles + ctx / 16 * dim_pairs * 32, k_tiles + (ctx / 16 + 1) * dim_pairs * 32,
              Bf16(0.0f));
  }
  auto key_row = [&](int64_t t) {
    return (kv_head * num_blocks + table[t / block_size]) * block_size + t % block_size;
  };
  int64_t t = 0;
  if (block_size % 16 == 0) {
    // A 16-key tile lies in one block, rows head_dim apart: gather each dimension pair's 16
    // 32-bit (k, k + 1) values across the tile's keys.
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(dim_pairs)));
    for (; t + 16 <= ctx; t += 16) {
      const int32_t* base = reinterpret_cast<const int32_t*>(k_cache + key_row(t) * head_dim);
      Bf16* kt = k_tiles + (t / 16) * dim_pairs * 32;
      for (int64_t p = 0; p < dim_pairs; ++p) {
        _mm512_storeu_si512(kt + p * 32, _mm512_i32gather_epi32(offsets, base + p, 4));
      }
    }
  }
  for (; t < ctx; ++t) {
    const Bf16* kr = k_cache + key_row(t) * head_dim;
    Bf16* kt = k_tiles + (t / 16) * dim_pairs * 32 + (t % 16) * 2;
    for (int64_t d = 0; d < head_dim; ++d) kt[(d / 2) * 32 + d % 2] = kr[d];
  }
  // Values: for each key pair and 16 dimensions, the two keys' values interleaved.
  for (int64_t pair = 0; pair < key_pairs; ++pair) {
    const int64_t t0 = 2 * pair, t1 = t0 + 1;
    const Bf16* v0 = v_cache + key_row(t0) * head_dim;
    const Bf16* v1 = t1 < ctx ? v_cache + key_row(t1) * head_dim : nullptr;
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
      const __m512i hi =
          v1 == nullptr ? _mm512_setzero_si512()
                        : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                reinterpret_cast<const __m256i*>(v1 + d))),
                                            16);
      _mm512_storeu_si512(v_tiles + (d / 16) * pair_stride * 32 + pair * 32,
                          _mm512_or_si512(lo, hi));
    }
  }
  zero_pair_padding(v_tiles, key_pairs, pair_stride, head_dim);
}

// The same tiles from tiled caches (kv_layout.h), whose blocks already are them: a key block is
// one K^T tile (its columns past the context are left as the cache has them: their scores are
// masked before the softmax reads them), and each token pair's 16 dimensions of a value block
// are one 64-byte V^T vector (the pair's second slot zeroed where it lies past the context, as
// pack_kv pads it). The results are the same bits as pack_kv's.
void copy_kv_tiles(const Bf16* k_cache, const Bf16* v_cache, const int32_t* table, int64_t ctx,
                   int64_t kv_head, int64_t num_blocks, int64_t head_dim, int64_t pair_stride,
                   Bf16* k_tiles, Bf16* v_tiles) {
  const int64_t block = infercloud_kv::kTiledBlock * head_dim;  // elements per block
  auto block_of = [&](const Bf16* cache, int64_t b) {
    return cache + (kv_head * num_blocks + table[b]) * block;
  };
  const int64_t blocks = (ctx + infercloud_kv::kTiledBlock - 1) / infercloud_kv::kTiledBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    std::copy_n(block_of(k_cache, b), block, k_tiles + b * block);
  }
  const int64_t key_pairs = (ctx + 1) / 2;
  for (int64_t pair = 0; pair < key_pairs; ++pair) {
    const Bf16* src = block_of(v_cache, pair / 8) + (pair % 8) * head_dim * 2;
    const bool lone = 2 * pair + 1 == ctx;
    for (int64_t d = 0; d < head_dim; d += 16) {
      __m512i x = _mm512_loadu_si512(src + d * 2);
      if (lone) x = _mm512_and_si512(x, _mm512_set1_epi32(0xFFFF));
      _mm512_storeu_si512(v_tiles + (d / 16) * pair_stride * 32 + pair * 32, x);
    }
  }
  zero_pair_padding(v_tiles, key_pairs, pair_stride, head_dim);
}

// Scores of `rows` query rows (from `q`, stride ldq) against key tiles [0, tiles): s [rows][ldS].
template <int MR>
void score_rows(const Bf16* q, int64_t ldq, int64_t dim_pairs, const Bf16* k_tiles,
                int64_t tiles, float* s, int64_t lds) {
  const int64_t tile_stride = dim_pairs * 32;
  int64_t t = 0;
  for (; t + 2 <= tiles; t += 2) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    infercloud_vec::dot_pairs<MR, 2>(q, ldq, dim_pairs, k_tiles + t * tile_stride, tile_stride, 0,
                                     acc);
    for (int m = 0; m < MR; ++m) {
      _mm512_storeu_ps(s + m * lds + t * 16, acc[m][0]);
      _mm512_storeu_ps(s + m * lds + t * 16 + 16, acc[m][1]);
    }
  }
  if (t < tiles) {
    __m512 acc[MR][1];
    for (int m = 0; m < MR; ++m) acc[m][0] = _mm512_setzero_ps();
    infercloud_vec::dot_pairs<MR, 1>(q, ldq, dim_pairs, k_tiles + t * tile_stride, tile_stride, 0,
                                     acc);
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(s + m * lds + t * 16, acc[m][0]);
  }
}

// out [rows][head_dim] = p [rows][pairs*2] (bf16) x values (V^T tiles).
template <int MR>
void weigh_values(const Bf16* p, int64_t ldp, int64_t pairs, const Bf16* v_tiles,
                  int64_t key_pairs, int64_t dim_tiles, Bf16* out, int64_t ldo) {
  const int64_t tile_stride = key_pairs * 32;
  for (int64_t t = 0; t < dim_tiles; t += 2) {  // head_dim is a multiple of 32 here
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    infercloud_vec::dot_pairs<MR, 2>(p, ldp, pairs, v_tiles + t * tile_stride, tile_stride, 0, acc);
    for (int m = 0; m < MR; ++m) {
      infercloud_vec::store16(out + m * ldo + t * 16, acc[m][0]);
      infercloud_vec::store16(out + m * ldo + t * 16 + 16, acc[m][1]);
    }
  }
}

// Probabilities of `rows` rows of scores (s, p: `width` apart): row m sees positions
// [0, positions[m]]; scaled, masked, softmax in float32, rounded to bfloat16, zero past what a
// row sees (up to width).
void softmax_rows(int rows, const int64_t* positions, float scale, float* s, Bf16* p,
                  int64_t width) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < rows; ++m) {
    float* sm = s + m * width;
    Bf16* pm = p + m * width;
    const int64_t visible = positions[m] + 1;
    auto lanes = [&](int64_t j) {
      const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, visible - j));
      return static_cast<__mmask16>((1u << n) - 1);
    };
    __m512 peak16 = neg_inf;
    for (int64_t j = 0; j < visible; j += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_mask_loadu_ps(neg_inf, lanes(j), sm + j), scale16);
      _mm512_storeu_ps(sm + j, v);
      peak16 = _mm512_max_ps(peak16, v);
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(peak16));
    __m512 sum16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < visible; j += 16) {
      const __m512 e =
          _mm512_maskz_mov_ps(lanes(j), infercloud_vec::exp16(_mm512_sub_ps(_mm512_loadu_ps(sm + j), peak)));
      _mm512_storeu_ps(sm + j, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum16));
    for (int64_t j = 0; j < width; j += 16) {
      const __m512 e = _mm512_maskz_loadu_ps(lanes(j), sm + j);
      infercloud_vec::store16(pm + j, _mm512_mul_ps(e, inv));
    }
  }
}
template <int MR>
void attend_rows(const Bf16* q, int64_t ldq, const int64_t* positions, int64_t head_dim,
                 const Bf16* k_tiles, const Bf16* v_tiles, int64_t pair_stride, float scale,
                 std::vector<float>& s, std::vector<Bf16>& p, Bf16* out, int64_t ldo) {
  const int64_t last = positions[MR - 1];  // rows are in position order
  const int64_t keys = last + 1, tiles = (keys + 15) / 16, width = tiles * 16;
  s.resize(MR * width);
  p.resize(MR * width);
  score_rows<MR>(q, ldq, head_dim / 2, k_tiles, tiles, s.data(), width);
  softmax_rows(MR, positions, scale, s.data(), p.data(), width);
  weigh_values<MR>(p.data(), width, (keys + 1) / 2, v_tiles, pair_stride, head_dim / 16, out, ldo);
}

#endif  // __AVX512BF16__

#if defined(INFERCLOUD_AMX)
// ---------------------------------------------------------------------------------------------
// The same two products on the AMX tile unit (where vdpbf16ps runs at half the float32 FMA rate,
// as on the AMX Xeon measured). The packed tiles above already are its B operands: 16 dimension
// pairs of a K^T tile (one kilobyte), 16 key pairs of a V^T tile (rows 64 bytes apart, the
// tiles padded to a whole number of 16 pairs). The A operands are 16 query rows (32 dimensions
// a step) and their probabilities (32 keys a step). Every tile register is 16 rows of 64 bytes:
//   tmm0, tmm5, tmm6, tmm7  C  scores of one key tile (tmm0), then 4 x 16 output dimensions
//   tmm1                    A  16 query rows, 32 dimensions
//   tmm2                    B  a key tile's 16 dimension pairs
//   tmm3                    A  16 rows of probabilities, 32 keys
//   tmm4                    B  16 key pairs of a value tile
constexpr int kAmxRows = 16;

void configure_prefill_tiles() {
  static const infercloud_amx::TileConfig config = [] {
    infercloud_amx::TileConfig c;
    for (int t = 0; t < 8; ++t) c.set(t, kAmxRows, 64);
    return c;
  }();
  _tile_loadconfig(&config);
}

struct AmxScratch {
  std::vector<float> s;
  std::vector<Bf16> p;
  alignas(64) Bf16 q[kAmxRows * 256];
  alignas(64) float o[kAmxRows * 256];
  int64_t positions[kAmxRows];
};

// One thread's share of a call (a chunk of parallel_for): our tile configuration is loaded
// before its first row block (oneDNN's kernels load their own on the same threads) and the
// tile state is released after its last.
class AmxThread {
 public:
  AmxThread() = default;
  AmxThread(const AmxThread&) = delete;
  AmxThread& operator=(const AmxThread&) = delete;
  ~AmxThread() {
    if (scratch_) _tile_release();
  }
  AmxScratch& scratch() {
    if (!scratch_) {
      scratch_ = std::make_unique<AmxScratch>();
      configure_prefill_tiles();
    }
    return *scratch_;
  }

 private:
  std::unique_ptr<AmxScratch> scratch_;
};

// `count` (<= 16) query rows (q, head_dim apart, at ascending `positions`) over their keys:
// out [count][head_dim]. Rows past count run as copies of the last position on zero queries
// (their results are dropped).
void attend_rows_amx(AmxScratch& sc, int64_t count, const Bf16* q, const int64_t* positions,
                     int64_t head_dim, const Bf16* k_tiles, const Bf16* v_tiles,
                     int64_t pair_stride, float scale, Bf16* out) {
  std::copy_n(q, count * head_dim, sc.q);
  std::fill(sc.q + count * head_dim, sc.q + kAmxRows * head_dim, Bf16(0.0f));
  for (int64_t m = 0; m < kAmxRows; ++m) sc.positions[m] = positions[std::min(m, count - 1)];
  const int64_t keys = sc.positions[kAmxRows - 1] + 1, tiles = (keys + 15) / 16;
  const int64_t width = (keys + 31) / 32 * 32;  // whole 32-key steps of the values' product
  sc.s.resize(kAmxRows * width);
  sc.p.resize(kAmxRows * width);
  const int64_t q_row = head_dim * 2, key_tile = head_dim * 16;  // bytes, elements
  for (int64_t t = 0; t < tiles; ++t) {
    _tile_zero(0);
    for (int64_t c = 0; c < head_dim / 32; ++c) {
      _tile_loadd(1, sc.q + 32 * c, q_row);
      _tile_loadd(2, k_tiles + t * key_tile + c * 512, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sc.s.data() + t * 16, width * 4);
  }
  softmax_rows(kAmxRows, sc.positions, scale, sc.s.data(), sc.p.data(), width);
  const int64_t value_tile = pair_stride * 32;  // elements
  for (int64_t j = 0; j < head_dim / 16; j += 4) {  // 4 output tiles of 16 dimensions at a time
    const int64_t nj = std::min<int64_t>(4, head_dim / 16 - j);
    const Bf16* vt = v_tiles + j * value_tile;
    _tile_zero(0);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t step = 0; step < width / 32; ++step) {
      _tile_loadd(3, sc.p.data() + step * 32, width * 2);
      const Bf16* v = vt + step * 512;  // 16 key pairs
      _tile_loadd(4, v, 64);
      _tile_dpbf16ps(0, 3, 4);
      if (nj > 1) {
        _tile_loadd(4, v + value_tile, 64);
        _tile_dpbf16ps(5, 3, 4);
      }
      if (nj > 2) {
        _tile_loadd(4, v + 2 * value_tile, 64);
        _tile_dpbf16ps(6, 3, 4);
      }
      if (nj > 3) {
        _tile_loadd(4, v + 3 * value_tile, 64);
        _tile_dpbf16ps(7, 3, 4);
      }
    }
    float* o = sc.o + j * 16;
    _tile_stored(0, o, head_dim * 4);
    if (nj > 1) _tile_stored(5, o + 16, head_dim * 4);
    if (nj > 2) _tile_stored(6, o + 32, head_dim * 4);
    if (nj > 3) _tile_stored(7, o + 48, head_dim * 4);
  }
  for (int64_t m = 0; m < count; ++m) {
    for (int64_t d = 0; d < head_dim; d += 16) {
      infercloud_vec::store16(out + m * head_dim + d, _mm512_loadu_ps(sc.o + m * head_dim + d));
    }
  }
}
#endif  // INFERCLOUD_AMX

#if defined(INFERCLOUD_VEC_LANES)
// ---------------------------------------------------------------------------------------------
// float32.

// Packs this (chunk, head)'s `ctx` keys as K^T tiles [ceil(ctx / kLanes)][head_dim][kLanes]
// (padding zero) and values as tiles [head_dim / kLanes][ctx][kLanes].
void pack_kv_f32(const float* k_cache, const float* v_cache, const int32_t* table, int64_t ctx,
                 int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                 float* k_tiles, float* v_tiles) {
  using infercloud_vec::kLanes;
  const int64_t key_tiles = (ctx + kLanes - 1) / kLanes, tile = head_dim * kLanes;
  std::fill(k_tiles + (key_tiles - 1) * tile, k_tiles + key_tiles * tile, 0.0f);
  for (int64_t t = 0; t < ctx; ++t) {
    const int64_t row =
        (kv_head * num_blocks + table[t / block_size]) * block_size + t % block_size;
    const float* kr = k_cache + row * head_dim;
    const float* vr = v_cache + row * head_dim;
    float* kt = k_tiles + (t / kLanes) * tile + t % kLanes;
    for (int64_t d = 0; d < head_dim; ++d) kt[d * kLanes] = kr[d];
    for (int64_t j = 0; j < head_dim / kLanes; ++j) {
      std::copy_n(vr + j * kLanes, kLanes, v_tiles + (j * ctx + t) * kLanes);
    }
  }
}

// y [MR][valid] = x [MR][k] (row stride ldx) times `tiles` packed tiles, kNR at a time.
template <int MR>
void rows_times_tiles(const float* x, int64_t ldx, int64_t k, const float* w, int64_t tiles,
                      int64_t tile_stride, float* y, int64_t ldy, int64_t valid) {
  using namespace infercloud_vec;
  int64_t t = 0;
  for (; t + 3 <= tiles; t += 3) {
    micro_kernel<MR, 3>(x, ldx, k, w + t * tile_stride, tile_stride, y + t * kLanes, ldy,
                        valid - t * kLanes);
  }
  with_count<2>(tiles - t, [&](auto nr) {
    micro_kernel<MR, decltype(nr)::value>(x, ldx, k, w + t * tile_stride, tile_stride,
                                          y + t * kLanes, ldy, valid - t * kLanes);
  });
}

// MR query rows (q, head_dim apart, at `positions`, ascending) over their keys: out [MR][head_dim].
template <int MR>
void attend_rows_f32(const float* q, const int64_t* positions, int64_t head_dim,
                     const float* k_tiles, const float* v_tiles, int64_t ctx, float scale,
                     std::vector<float>& s, float* out) {
  using namespace infercloud_vec;
  const int64_t keys = positions[MR - 1] + 1, tiles = (keys + kLanes - 1) / kLanes;
  const int64_t width = tiles * kLanes;
  s.resize(MR * width);
  rows_times_tiles<MR>(q, head_dim, head_dim, k_tiles, tiles, head_dim * kLanes, s.data(), width,
                       width);
  const vf scale_v = vset1(scale);
  for (int m = 0; m < MR; ++m) {
    float* sm = s.data() + m * width;
    const int64_t visible = positions[m] + 1;
    int64_t j = 0;
    for (; j + kLanes <= visible; j += kLanes) vstore(sm + j, vmul(vload(sm + j), scale_v));
    for (; j < visible; ++j) sm[j] *= scale;
    const float inv = exp_and_inv_sum(sm, visible);
    const vf inv_v = vset1(inv);
    for (j = 0; j + kLanes <= visible; j += kLanes) vstore(sm + j, vmul(vload(sm + j), inv_v));
    for (; j < visible; ++j) sm[j] *= inv;
    std::fill(sm + visible, sm + keys, 0.0f);  // the future: probability zero
  }
  rows_times_tiles<MR>(s.data(), width, keys, v_tiles, head_dim / kLanes, ctx * kLanes, out,
                       head_dim, head_dim);
}

void prefill_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const std::vector<Chunk>& chunks, int64_t num_kv_heads, int64_t num_blocks,
                 float scale, at::Tensor& out) {
  using namespace infercloud_vec;
  const int64_t head_dim = q.size(2), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1);
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const PackedTasks<float> packed = pack_tasks<float>(
      chunks, num_kv_heads,
      [&](int64_t ctx) {
        return std::pair<int64_t, int64_t>{(ctx + kLanes - 1) / kLanes * kLanes * head_dim,
                                           ctx * head_dim};
      },
      [&](const Chunk& ch, int64_t kv_head, float* keys, float* values) {
        pack_kv_f32(kc, vc, ch.table, ch.start + ch.len, kv_head, num_blocks, block_size,
                    head_dim, keys, values);
      });
  for_each_row_block<float, kMR, std::vector<float>>(
      q.data_ptr<float>(), out.data_ptr<float>(), chunks, num_kv_heads, num_heads, head_dim,
      [&](std::vector<float>& s, int64_t count, const float* q_rows, const int64_t* positions,
          int64_t task, int64_t ctx, float* o_rows) {
        const float* kt = packed.keys(task);
        const float* vt = packed.values(task);
        with_count<kMR>(count, [&](auto rows) {
          attend_rows_f32<decltype(rows)::value>(q_rows, positions, head_dim, kt, vt, ctx, scale,
                                                 s, o_rows);
        });
      });
}
#endif  // INFERCLOUD_VEC_LANES

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& chunk_starts, const at::Tensor& chunk_lens,
                                   double scale, int64_t num_blocks, bool tiled,
                                   bool tile_unit) {
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && (f32 || q.scalar_type() == at::kBFloat16),
              "q must be contiguous bfloat16 or float32 [tokens, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "caches must be contiguous [num_kv_heads * num_blocks, block_size, head_dim] of q's "
              "dtype");
#if !defined(__AVX512BF16__)
  TORCH_CHECK(f32, "paged_prefill_attention needs a CPU with AVX512-BF16 for bfloat16");
#endif
#if !defined(INFERCLOUD_VEC_LANES)
  TORCH_CHECK(!f32, "paged_prefill_attention needs AVX2 or AVX-512 for float32");
#endif
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(k_cache.size(2) == head_dim && head_dim % 32 == 0 && head_dim <= 256,
              "head_dim must match the caches and be a multiple of 32, at most 256");
  TORCH_CHECK(num_blocks > 0 && k_cache.size(0) % num_blocks == 0,
              "cache rows are not a multiple of num_blocks");
  const int64_t num_kv_heads = k_cache.size(0) / num_blocks;
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "num_heads is not a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && chunk_starts.scalar_type() == at::kInt &&
                  chunk_lens.scalar_type() == at::kInt,
              "block_tables, chunk_starts and chunk_lens must be int32");
  const int64_t num_chunks = chunk_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_chunks &&
                  block_tables.is_contiguous() && chunk_starts.size(0) == num_chunks &&
                  chunk_starts.is_contiguous() && chunk_lens.is_contiguous(),
              "one block table row, start and length per chunk");
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  TORCH_CHECK(!tiled || (block_size == 16 && !f32), "tiled caches are bfloat16, blocks of 16");
  const int32_t* starts = chunk_starts.data_ptr<int32_t>();
  const int32_t* lens = chunk_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t rows = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t ctx = static_cast<int64_t>(starts[c]) + lens[c];
    TORCH_CHECK(starts[c] >= 0 && lens[c] >= 1 && ctx <= max_blocks * block_size, "chunk ", c,
                " (start ", starts[c], ", length ", lens[c], ") does not fit its block table");
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[c * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is not in [0, ", num_blocks,
                  ")");
    }
    rows += lens[c];
  }
  TORCH_CHECK(rows == q.size(0), "the chunks' lengths do not add up to q's tokens");
  at::Tensor out = at::empty({q.size(0), q.size(1) * head_dim}, q.options());
  std::vector<Chunk> chunks;
  int64_t row = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    chunks.push_back({row, starts[c], lens[c], tables + c * max_blocks});
    row += lens[c];
  }
#if defined(INFERCLOUD_VEC_LANES)
  if (f32) {
    prefill_f32(q, k_cache, v_cache, chunks, num_kv_heads, num_blocks, static_cast<float>(scale),
                out);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  const int64_t num_heads = q.size(1);
  const Bf16* kc = k_cache.data_ptr<Bf16>();
  const Bf16* vc = v_cache.data_ptr<Bf16>();
  // V^T tiles hold a whole number of 16 key pairs: the tile path reads them 16 at a time.
  auto pair_stride = [](int64_t ctx) { return ((ctx + 1) / 2 + 15) / 16 * 16; };
  const PackedTasks<Bf16> packed = pack_tasks<Bf16>(
      chunks, num_kv_heads,
      [&](int64_t ctx) {
        return std::pair<int64_t, int64_t>{(ctx + 15) / 16 * head_dim * 16,
                                           pair_stride(ctx) * 2 * head_dim};
      },
      [&](const Chunk& ch, int64_t kv_head, Bf16* keys, Bf16* values) {
        const int64_t ctx = ch.start + ch.len;
        if (tiled) {
          copy_kv_tiles(kc, vc, ch.table, ctx, kv_head, num_blocks, head_dim, pair_stride(ctx),
                        keys, values);
        } else {
          pack_kv(kc, vc, ch.table, ctx, kv_head, num_blocks, block_size, head_dim,
                  pair_stride(ctx), keys, values);
        }
      });
  const float scale_f = static_cast<float>(scale);
#if defined(INFERCLOUD_AMX)
  if (tile_unit && infercloud_amx::tiles_available()) {
    for_each_row_block<Bf16, kAmxRows, AmxThread>(
        q.data_ptr<Bf16>(), out.data_ptr<Bf16>(), chunks, num_kv_heads, num_heads, head_dim,
        [&](AmxThread& thread, int64_t count, const Bf16* q_rows, const int64_t* positions,
            int64_t task, int64_t ctx, Bf16* o_rows) {
          attend_rows_amx(thread.scratch(), count, q_rows, positions, head_dim,
                          packed.keys(task), packed.values(task), pair_stride(ctx), scale_f,
                          o_rows);
        });
    return out;
  }
#endif
  struct Scratch {
    std::vector<float> s;
    std::vector<Bf16> p;
  };
  for_each_row_block<Bf16, kRows, Scratch>(
      q.data_ptr<Bf16>(), out.data_ptr<Bf16>(), chunks, num_kv_heads, num_heads, head_dim,
      [&](Scratch& scratch, int64_t count, const Bf16* q_rows, const int64_t* positions,
          int64_t task, int64_t ctx, Bf16* o_rows) {
        const Bf16* kt = packed.keys(task);
        const Bf16* vt = packed.values(task);
        infercloud_vec::with_count<kRows>(count, [&](auto rows) {
          attend_rows<decltype(rows)::value>(q_rows, head_dim, positions, head_dim, kt, vt,
                                             pair_stride(ctx), scale_f, scratch.s, scratch.p,
                                             o_rows, head_dim);
        });
      });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor chunk_starts, Tensor chunk_lens, float scale, int num_blocks, bool tiled=False, "
      "bool tile_unit=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(infercloud, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
