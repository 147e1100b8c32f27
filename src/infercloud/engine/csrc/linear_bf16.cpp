// y = x W^T for bfloat16 x and W on CPUs with AVX512-BF16 (vdpbf16ps), W packed once.
//
// Packed layout: W [N, K] becomes [ceil(N/16)][ceil(K/2)][16][2] bfloat16: one 64-byte vector
// holds two consecutive k of 16 consecutive output columns, the operand vdpbf16ps takes; the
// columns past N and the k past K are zero. A column tile's weights are one contiguous run of
// ceil(K/2) * 64 bytes, read front to back.
//
// Kernel: MR rows of x by NR column tiles (16 columns each) accumulate in MR * NR float32
// vectors; each k pair costs NR weight loads, MR broadcasts of two x values and MR * NR
// vdpbf16ps. A thread takes whole groups of NR tiles (the work is split over N), and runs every
// MR-row block of x over a group's weights, so that those come from memory once and from L2 for
// the other row blocks. Results are rounded to bfloat16 once, at the end (round to nearest
// even), as oneDNN's bfloat16 GEMM does; the float32 sums run in another order than oneDNN's,
// so the last bit of an output can differ from F.linear's.
//
// On CPUs with AMX (the tile unit), the same packed layout feeds tile loads directly: 16 pairs of
// one column tile are 16 rows of 64 bytes, one contiguous kilobyte, which is the B operand
// tdpbf16ps takes. The tile path (`tiles=True`, where the CPU has AMX-BF16, the kernel grants
// the process tile state, and K is a multiple of 32) runs 32 rows of x by 2 column tiles at a
// time in the 8 tile registers: C[2][2] (float32 16x16) += A[2] (16 rows x 32 k) . B[2]; rows
// past the last multiple of 32 are copied into a zero-padded block first. The tile unit flushes
// denormal inputs and results to zero; the float32 sums run in yet another order.
//
// Where vdpbf16ps is slow (an Intel Xeon whose VM hides AMX issues one every other cycle, a
// quarter of the rate of float32 FMAs), the vector path can multiply on float32 FMAs instead
// (`set_linear_bf16_fma`, a switch of the process): the same packed weights, each 64-byte
// vector widened in registers to its k = 2p and 2p + 1 halves, and x widened to float32 once
// per call. The engine times both ways at start and sets the faster (linear_choice.py).
//
// The MLP's gate and up projections with SiLU in one call (`linear_silu_bf16`): their weights,
// gate [I, K] over up [I, K], are packed with the column tiles interleaved (gate tile 0, up
// tile 0, gate tile 1, ...: `interleave_gate_up`), so that the two column tiles of a group are a
// gate tile and its up tile. Each group's epilogue then writes silu(gate) * up for its 16
// columns, with silu_and_mul's arithmetic on the bfloat16-rounded products (layer_ops.cpp), so
// the result is the same bits as silu_and_mul(linear_bf16(x, plain packing)); the [rows, 2I]
// product is never written, and no second pass reads it back.
//
// Registered as torch.ops.infercloud.{pack_linear_bf16, linear_bf16, interleave_gate_up,
// linear_silu_bf16, has_linear_bf16, has_linear_tiles, set_linear_bf16_fma}; built and loaded
// by cpu_kernels.py. Where the CPU lacks AVX512-BF16, has_linear_bf16() is false and the others
// refuse.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "bf16_dot.h"
#include "vec_math.h"
#endif

#include "amx.h"

namespace {

constexpr int64_t kTile = 16;  // output columns per vector
constexpr int64_t kNR = 3;     // column tiles per group
constexpr int64_t kMR = 8;     // rows of x per block
// Each weight load asks for the line 16 k-pairs ahead in its tile (a tile is read front to back):
// in a decode step the weights come from memory, and the linear layers took 12.3 ms of it
// without, 11.5 ms with (a prefetch past a tile's end touches the next tile or nothing: a
// prefetch never faults).
constexpr int64_t kPrefetchPairs = 16;

bool has_linear_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Whether the vector path (no tile unit) multiplies on float32 multiply-adds instead of
// vdpbf16ps: one switch for the process, set once at engine start by timing both
// (`linear_choice.py`), read by every call after. Off by default.
std::atomic<bool> g_fma{false};

bool use_fma() { return g_fma.load(std::memory_order_relaxed); }

// Sets the switch; returns its previous value.
bool set_linear_bf16_fma(bool on) {
  TORCH_CHECK(has_linear_bf16(), "linear_bf16: this CPU (or build) has no AVX512-BF16");
  return g_fma.exchange(on);
}

// Whether the tile path can run in this process: built for AMX-BF16, and Linux has granted the
// process the tile data state (asked once; a kernel without AMX support refuses).
bool has_linear_tiles() { return infercloud_amx::tiles_available(); }

at::Tensor pack_linear_bf16(const at::Tensor& weight) {
  TORCH_CHECK(has_linear_bf16(), "linear_bf16: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_linear_bf16: weight must be bfloat16 [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t tiles = (n + kTile - 1) / kTile, pairs = (k + 1) / 2;
  at::Tensor packed = at::zeros({tiles, pairs, kTile, 2}, w.options());
  const c10::BFloat16* src = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < kTile && t * kTile + j < n; ++j) {
        const c10::BFloat16* row = src + (t * kTile + j) * k;
        for (int64_t kk = 0; kk < k; ++kk) {
          dst[((t * pairs + kk / 2) * kTile + j) * 2 + kk % 2] = row[kk];
        }
      }
    }
  });
  return packed;
}

#if defined(__AVX512BF16__)
// out[0..15] = round(round(silu(g)) * u) with g and u first rounded to bfloat16: silu_and_mul's
// arithmetic (layer_ops.cpp) on what linear_bf16 would have stored.
inline void store_silu16(c10::BFloat16* out, __m512 g, __m512 u) {
  using namespace infercloud_vec;
  const vf gate = vround<c10::BFloat16>(g);
  const vf silu = vdiv(gate, vadd(vset1(1.0f), vexp(vsub(vzero(), gate))));
  store16(out, vmul(vround<c10::BFloat16>(silu), vround<c10::BFloat16>(u)));
}

// A block's float32 sums, rounded to bfloat16, into y [MR, up to NR * 16] (valid_cols of them);
// with kSilu (NR 2: a gate tile and its up tile), y [MR, 16] = silu(gate) * up.
template <int MR, int NR, bool kSilu>
inline void store_block(__m512 (&acc)[MR][NR], c10::BFloat16* y, int64_t ldy,
                        int64_t valid_cols) {
  if constexpr (kSilu) {
    for (int m = 0; m < MR; ++m) store_silu16(y + m * ldy, acc[m][0], acc[m][1]);
    return;
  }
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < NR; ++t) {
      const int64_t col = t * kTile;
      if (col + kTile <= valid_cols) {
        infercloud_vec::store16(y + m * ldy + col, acc[m][t]);
      } else if (col < valid_cols) {
        alignas(64) c10::BFloat16 buf[kTile];
        infercloud_vec::store16(buf, acc[m][t]);
        for (int64_t j = 0; j < valid_cols - col; ++j) y[m * ldy + col + j] = buf[j];
      }
    }
  }
}

// rows x [MR, K] (row stride ldx, in elements) by NR tiles of packed weights -> y [MR, NR*16];
// with kSilu, NR is 2, the tiles are a gate tile and its up tile, and y gets [MR, 16] of
// silu(gate) * up.
// `side`: a tile of the next group, asked into L2 one line per k pair (see rows_by_tiles).
template <int MR, int NR, bool kSilu = false>
inline void micro_kernel(const c10::BFloat16* x, int64_t ldx, int64_t k,
                         const c10::BFloat16* w_tiles, int64_t tile_stride, c10::BFloat16* y,
                         int64_t ldy, int64_t valid_cols,
                         const c10::BFloat16* side = nullptr) {
  static_assert(!kSilu || NR == 2, "a SiLU group is one gate tile and one up tile");
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t full_pairs = k / 2;
  infercloud_vec::dot_pairs<MR, NR>(x, ldx, full_pairs, w_tiles, tile_stride, kPrefetchPairs, acc,
                                    side);
  if (k % 2 != 0) {  // the last k alone: pair it with a zero (the packed weight is zero there)
    const int64_t p = full_pairs;
    __m512bh w[NR];
    for (int t = 0; t < NR; ++t) {
      w[t] = reinterpret_cast<__m512bh>(
          _mm512_loadu_si512(reinterpret_cast<const void*>(w_tiles + t * tile_stride + p * 32)));
    }
    for (int m = 0; m < MR; ++m) {
      const int32_t lone = static_cast<int32_t>(x[m * ldx + k - 1].x);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(lone));
      for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, w[t]);
    }
  }
  store_block<MR, NR, kSilu>(acc, y, ldy, valid_cols);
}

// The same block on float32 multiply-adds, for CPUs where vdpbf16ps (twice a multiply-add's
// work) issues at less than half their rate (an Intel Xeon without AMX: 1.1-1.3 G vdpbf16ps/s
// against 4.7-5.5 G vfmadd231ps/s per core, so 70-84 against 151-175 GFLOP/s). x is float32 here ([MR, K rounded up to even],
// the padding k zero; `x_for_fma`); each 64-byte weight vector gives two float32 vectors, its
// low halves (k = 2p: shifted up 16 bits) and its high halves (k = 2p + 1: masked), which is
// their exact value, so a product is exact and each multiply-add rounds once. The sums run
// k = 2p then 2p + 1, where vdpbf16ps adds the pair's two products to the sum at once, so the
// last bit of an output can differ between the two paths. `side` as in the kernel above.
template <int MR, int NR, bool kSilu = false>
inline void micro_kernel(const float* x, int64_t ldx, int64_t k, const c10::BFloat16* w_tiles,
                         int64_t tile_stride, c10::BFloat16* y, int64_t ldy, int64_t valid_cols,
                         const c10::BFloat16* side = nullptr) {
  static_assert(!kSilu || NR == 2, "a SiLU group is one gate tile and one up tile");
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t pairs = (k + 1) / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    if (side != nullptr) __builtin_prefetch(side + p * 32, 0, 2);
    __m512 lo[NR], hi[NR];
    for (int t = 0; t < NR; ++t) {
      const c10::BFloat16* wt = w_tiles + t * tile_stride + p * 32;
      __builtin_prefetch(wt + kPrefetchPairs * 32, 0, 3);
      const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(wt));
      lo[t] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      hi[t] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + 2 * p]);
      for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_fmadd_ps(a, lo[t], acc[m][t]);
      const __m512 b = _mm512_set1_ps(x[m * ldx + 2 * p + 1]);
      for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_fmadd_ps(b, hi[t], acc[m][t]);
    }
  }
  store_block<MR, NR, kSilu>(acc, y, ldy, valid_cols);
}

// Every row block of x runs over the group's weights: the first block reads them from memory,
// the others from L2. `next_tiles` (the thread's next group, NR tiles `tile_stride` apart; null
// for none): while block b = 1 .. NR runs, it asks for tile b - 1 of the next group into L2,
// one line per k pair, so that the next group's first block does not wait on memory. Before,
// in a decode step of 32 rows (4 blocks of 8), the first block streamed the weights at four
// times the rate the group's work needs: the linear layers read memory at 22 GB/s where a
// plain read reaches 80, and took 12.3 ms against 9.8 ms with the weights in cache; with this,
// 26-29 GB/s and 9.4-10.3 ms (benchmarks/linear_kernel.py --stream --rows 32, a Zen 5 EPYC). A
// single block (8 rows or fewer) has no later pass to hide the next group behind; with two
// (16 rows) only the first tile is asked for (asking for all three in that one pass, with a
// loop over the side tiles in the inner loop, made 32 rows slower: 10.1-10.7 ms).
template <int NR, bool kSilu = false, typename X>
void rows_by_tiles(const X* x, int64_t ldx, int64_t rows, int64_t k,
                   const c10::BFloat16* w_tiles, int64_t tile_stride, c10::BFloat16* y,
                   int64_t ldy, int64_t valid_cols,
                   const c10::BFloat16* next_tiles = nullptr) {
  auto side = [&](int64_t block) -> const c10::BFloat16* {
    if (next_tiles == nullptr || block < 1 || block > NR) return nullptr;
    return next_tiles + (block - 1) * tile_stride;
  };
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) {
    micro_kernel<kMR, NR, kSilu>(x + r * ldx, ldx, k, w_tiles, tile_stride, y + r * ldy, ldy,
                                 valid_cols, side(r / kMR));
  }
  const X* xr = x + r * ldx;
  c10::BFloat16* yr = y + r * ldy;
  auto tail = [&](auto mr) {
    micro_kernel<decltype(mr)::value, NR, kSilu>(xr, ldx, k, w_tiles, tile_stride, yr, ldy,
                                                 valid_cols, side(r / kMR));
  };
  switch (rows - r) {
    case 0: break;
    case 1: tail(std::integral_constant<int, 1>{}); break;
    case 2: tail(std::integral_constant<int, 2>{}); break;
    case 3: tail(std::integral_constant<int, 3>{}); break;
    case 4: tail(std::integral_constant<int, 4>{}); break;
    case 5: tail(std::integral_constant<int, 5>{}); break;
    case 6: tail(std::integral_constant<int, 6>{}); break;
    default: tail(std::integral_constant<int, 7>{}); break;
  }
}
#endif  // __AVX512BF16__

#if defined(INFERCLOUD_AMX)
constexpr int64_t kTileRows = 16;   // rows of an A or C tile
constexpr int64_t kTileK = 32;      // k per tile step: 64 bytes of bfloat16 per A row
constexpr int64_t kTileBlock = 32;  // rows of x per block: two A tiles

// tmm0..3: C[i][j] (i: row tile, j: column tile); tmm4, tmm5: A[i]; tmm6, tmm7: B[j]. Every
// tile is 16 rows of 64 bytes. Loaded in each thread before its work: oneDNN's kernels load
// their own configuration on the same threads.
infercloud_amx::TileConfig tile_config() {
  infercloud_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.set(t, kTileRows, 64);
  return config;
}

void configure_tiles() {
  static const infercloud_amx::TileConfig config = tile_config();
  _tile_loadconfig(&config);
}

// One block of 32 rows of x (row stride ldx) by NR (1 or 2) column tiles; rows_valid and
// cols_valid bound what is written to y. With kSilu, NR is 2 (a gate tile and its up tile) and
// y gets 16 columns of silu(gate) * up.
template <int NR, bool kSilu = false>
void tile_block(const c10::BFloat16* x, int64_t ldx, int64_t k, const c10::BFloat16* w_tiles,
                int64_t tile_stride, c10::BFloat16* y, int64_t ldy, int64_t rows_valid,
                int64_t cols_valid) {
  _tile_zero(0);
  _tile_zero(1);
  if (NR == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * 2, w_stride = 64;  // bytes
  for (int64_t kk = 0; kk < k; kk += kTileK) {
    const c10::BFloat16* w0 = w_tiles + kk * kTile;  // pair kk/2 of tile 0: (kk/2) * 32 elements
    _tile_loadd(4, x + kk, x_stride);
    _tile_loadd(5, x + kTileRows * ldx + kk, x_stride);
    _tile_loadd(6, w0, w_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (NR == 2) {
      _tile_loadd(7, w0 + tile_stride, w_stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[kTileRows][kTile];
  if constexpr (kSilu) {
    static_assert(NR == 2, "a SiLU group is one gate tile and one up tile");
    alignas(64) float u[kTileRows][kTile];
    for (int i = 0; i < 2; ++i) {
      if (i == 0) {
        _tile_stored(0, c, kTile * 4);
        _tile_stored(2, u, kTile * 4);
      } else {
        _tile_stored(1, c, kTile * 4);
        _tile_stored(3, u, kTile * 4);
      }
      for (int64_t r = 0; r < kTileRows && i * kTileRows + r < rows_valid; ++r) {
        store_silu16(y + (i * kTileRows + r) * ldy, _mm512_load_ps(c[r]), _mm512_load_ps(u[r]));
      }
    }
    return;
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = j * kTile;
    if (col >= cols_valid) break;
    const int64_t width = std::min(kTile, cols_valid - col);
    for (int i = 0; i < 2; ++i) {
      // tile numbers are immediates: C[i][j] is tmm(2j + i)
      if (j == 0 && i == 0) _tile_stored(0, c, kTile * 4);
      if (j == 0 && i == 1) _tile_stored(1, c, kTile * 4);
      if (j == 1 && i == 0) _tile_stored(2, c, kTile * 4);
      if (j == 1 && i == 1) _tile_stored(3, c, kTile * 4);
      for (int64_t r = 0; r < kTileRows && i * kTileRows + r < rows_valid; ++r) {
        c10::BFloat16* out = y + (i * kTileRows + r) * ldy + col;
        if (width == kTile) {
          infercloud_vec::store16(out, _mm512_load_ps(c[r]));
        } else {
          alignas(64) c10::BFloat16 buf[kTile];
          infercloud_vec::store16(buf, _mm512_load_ps(c[r]));
          std::memcpy(out, buf, width * sizeof(c10::BFloat16));
        }
      }
    }
  }
}

// y [rows, out_features] = x W^T; with silu (the tiles are gate/up pairs) y [rows, tiles * 8]
// = silu(gate) * up, out_features being tiles * 8.
void linear_tiles(const c10::BFloat16* xp, int64_t ldx, int64_t rows, int64_t k,
                  const c10::BFloat16* wp, int64_t tiles, int64_t tile_stride, c10::BFloat16* yp,
                  int64_t out_features, bool silu) {
  // The last rows, short of a 32-row block, go through a zero-padded copy.
  const int64_t full_blocks = rows / kTileBlock, tail = rows % kTileBlock;
  std::vector<c10::BFloat16> padded;
  if (tail != 0) {
    padded.assign(kTileBlock * k, c10::BFloat16(0.0f));
    for (int64_t r = 0; r < tail; ++r) {
      std::memcpy(padded.data() + r * k, xp + (full_blocks * kTileBlock + r) * ldx,
                  k * sizeof(c10::BFloat16));
    }
  }
  const int64_t groups = (tiles + 1) / 2;
  auto one_group = [&](int64_t g) {
    const int64_t first_tile = g * 2;
    const int64_t nr = std::min<int64_t>(2, tiles - first_tile);
    const int64_t col = silu ? g * kTile : first_tile * kTile;
    const int64_t valid = std::min(nr * kTile, out_features - col);
    const c10::BFloat16* w_tiles = wp + first_tile * tile_stride;
    for (int64_t b = 0; b <= full_blocks; ++b) {
      const bool last = b == full_blocks;
      if (last && tail == 0) break;
      const c10::BFloat16* xb = last ? padded.data() : xp + b * kTileBlock * ldx;
      const int64_t ld = last ? k : ldx;
      const int64_t rows_valid = last ? tail : kTileBlock;
      c10::BFloat16* yb = yp + b * kTileBlock * out_features + col;
      if (silu) {
        tile_block<2, true>(xb, ld, k, w_tiles, tile_stride, yb, out_features, rows_valid, valid);
      } else if (nr == 2) {
        tile_block<2>(xb, ld, k, w_tiles, tile_stride, yb, out_features, rows_valid, valid);
      } else {
        tile_block<1>(xb, ld, k, w_tiles, tile_stride, yb, out_features, rows_valid, valid);
      }
    }
  };
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) one_group(g);
    _tile_release();
  });
}
#endif  // INFERCLOUD_AMX

#if defined(__AVX512BF16__)
// y [rows, out_features] = x W^T on the vector units (vdpbf16ps for bfloat16 x, float32
// multiply-adds for float32 x); with silu (the tiles are gate/up pairs) y [rows, tiles * 8]
// = silu(gate) * up. A thread takes whole groups of column tiles.
template <typename X>
void vector_gemm(const X* xp, int64_t ldx, int64_t rows, int64_t k, const c10::BFloat16* wp,
                 int64_t tiles, int64_t tile_stride, c10::BFloat16* yp, int64_t out_features,
                 bool silu) {
  if (silu) {  // groups of one gate tile and its up tile
    at::parallel_for(0, tiles / 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const c10::BFloat16* next = g + 1 < end ? wp + 2 * (g + 1) * tile_stride : nullptr;
        rows_by_tiles<2, true>(xp, ldx, rows, k, wp + 2 * g * tile_stride, tile_stride,
                               yp + g * kTile, out_features, kTile, next);
      }
    });
    return;
  }
  const int64_t groups = (tiles + kNR - 1) / kNR;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first_tile = g * kNR;
      const int64_t nr = std::min(kNR, tiles - first_tile);
      const int64_t col = first_tile * kTile;
      const int64_t valid = std::min(nr * kTile, out_features - col);
      const c10::BFloat16* w_tiles = wp + first_tile * tile_stride;
      const c10::BFloat16* next = g + 1 < end ? w_tiles + kNR * tile_stride : nullptr;
      if (nr == 3) {
        rows_by_tiles<3>(xp, ldx, rows, k, w_tiles, tile_stride, yp + col, out_features, valid,
                         next);
      } else if (nr == 2) {
        rows_by_tiles<2>(xp, ldx, rows, k, w_tiles, tile_stride, yp + col, out_features, valid,
                         next);
      } else {
        rows_by_tiles<1>(xp, ldx, rows, k, w_tiles, tile_stride, yp + col, out_features, valid,
                         next);
      }
    }
  });
}

// x [rows, K] bfloat16 as float32 [rows, K rounded up to even] (row stride the return value),
// the padding column zero, in `buf`: the float32 micro kernel reads k in pairs, as the packed
// weights hold them. `buf` is the calling thread's, kept between calls at the size of its
// largest (a decode step's 32 rows by 576 are 72 KB, a 512-token step's down-projection input
// 3 MB; allocating and converting through aten cost 30 us a call on average).
int64_t x_for_fma(const c10::BFloat16* x, int64_t ldx, int64_t rows, int64_t k,
                  std::vector<float>& buf) {
  const int64_t ld = k + (k % 2);
  if (static_cast<int64_t>(buf.size()) < rows * ld) buf.resize(rows * ld);
  float* out = buf.data();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / ld), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* src = x + r * ldx;
      float* dst = out + r * ld;
      int64_t j = 0;
      for (; j + 16 <= k; j += 16) _mm512_storeu_ps(dst + j, infercloud_vec::load16(src + j));
      for (; j < k; ++j) dst[j] = static_cast<float>(src[j]);
      if (ld != k) dst[k] = 0.0f;
    }
  });
  return ld;
}
#endif  // __AVX512BF16__

// The shared body of linear_bf16 and linear_silu_bf16: checks, then y = x W^T, or with silu
// (packed by interleave_gate_up) y = silu(x Wg^T) * (x Wu^T), [rows, tiles * 8].
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                     bool use_tiles, bool silu, const char* name) {
  TORCH_CHECK(has_linear_bf16(), name, ": this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name,
              ": x must be bfloat16 [rows, in_features], rows dense");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kTile && packed.size(3) == 2,
              name, ": packed must come from pack_linear_bf16");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t tiles = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs == (k + 1) / 2, name, ": in_features of x and the weight differ");
  if (silu) {
    TORCH_CHECK(tiles % 2 == 0 && out_features == tiles * kTile / 2, name,
                ": intermediate_size must be half the packed weight's rows, a multiple of 16");
  } else {
    TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile, name,
                ": out_features does not match the packed weight");
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
#if defined(__AVX512BF16__)
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), tile_stride = pairs * 32;
#if defined(INFERCLOUD_AMX)
  if (use_tiles && k % kTileK == 0 && has_linear_tiles()) {
    linear_tiles(xp, ldx, rows, k, wp, tiles, tile_stride, yp, out_features, silu);
    return y;
  }
#endif
  if (use_fma()) {
    thread_local std::vector<float> x32;
    const int64_t ld = x_for_fma(xp, ldx, rows, k, x32);
    vector_gemm(x32.data(), ld, rows, k, wp, tiles, tile_stride, yp, out_features, silu);
  } else {
    vector_gemm(xp, ldx, rows, k, wp, tiles, tile_stride, yp, out_features, silu);
  }
#endif
  return y;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       bool use_tiles) {
  return gemm_bf16(x, packed, out_features, use_tiles, false, "linear_bf16");
}

// packed: pack_linear_bf16 of [gate; up] ([2I, K], I a multiple of 16), its column tiles
// reordered by interleave_gate_up. Returns silu(x gate^T) * (x up^T), [rows, I].
at::Tensor linear_silu_bf16(const at::Tensor& x, const at::Tensor& packed,
                            int64_t intermediate_size, bool use_tiles) {
  return gemm_bf16(x, packed, intermediate_size, use_tiles, true, "linear_silu_bf16");
}

// The packed [gate; up] weight (pack_linear_bf16, [2I/16][pairs][16][2]) with its column tiles
// reordered gate 0, up 0, gate 1, up 1, ...: what linear_silu_bf16 reads. A copy; the tiles
// themselves are unchanged.
at::Tensor interleave_gate_up(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) % 2 == 0 && packed.size(2) == kTile &&
                  packed.size(3) == 2,
              "interleave_gate_up: packed must be pack_linear_bf16 of [gate; up] with the "
              "intermediate size a multiple of 16");
  const int64_t half = packed.size(0) / 2;
  return packed.view({2, half, packed.size(1), kTile, 2}).transpose(0, 1).contiguous().view(
      packed.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) {
  m.def("has_linear_bf16() -> bool", &has_linear_bf16);
  m.def("pack_linear_bf16(Tensor weight) -> Tensor");
  m.def("has_linear_tiles() -> bool", &has_linear_tiles);
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, bool use_tiles=True) -> Tensor");
  m.def("interleave_gate_up(Tensor packed) -> Tensor");
  m.def("set_linear_bf16_fma(bool on) -> bool", &set_linear_bf16_fma);
  m.def(
      "linear_silu_bf16(Tensor x, Tensor packed, int intermediate_size, bool use_tiles=True) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(infercloud, CPU, m) {
  m.impl("pack_linear_bf16", &pack_linear_bf16);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("interleave_gate_up", &interleave_gate_up);
  m.impl("linear_silu_bf16", &linear_silu_bf16);
}

