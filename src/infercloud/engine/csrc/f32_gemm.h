// The float32 matrix-product kernel shared by linear_f32.cpp and prefill_attention.cpp: MR rows
// of x times NR packed column tiles, on the vector paths of vec_math.h (AVX2 with FMA: 8 lanes;
// AVX-512: 16).
//
// Packed tiles: column tile t holds, for each k, one vector of kLanes consecutive output
// columns' values (a weight matrix W [N, K] becomes [ceil(N / kLanes)][K][kLanes]); a tile is
// one contiguous run, read front to back, `tile_stride` elements from the next.
//
// MR rows by NR tiles accumulate in MR * NR vectors; each k costs NR weight loads, MR
// broadcasts of one x value and MR * NR fused multiply-adds. With AVX2's 16 vector registers
// kMR = 4 and kNR = 3 (12 accumulators, 3 weights, 1 broadcast); with AVX-512's 32, kMR = 8.
// Each output sums its K products in k order, one rounding per multiply-add.
#pragma once

#include <cstdint>

#include "vec_math.h"

#if defined(INFERCLOUD_VEC_LANES)
namespace infercloud_vec {

constexpr int64_t kNR = 3;                      // column tiles per group
constexpr int64_t kMR = kLanes == 16 ? 8 : 4;  // rows of x per block

// The next group's weights, asked for a slice per row block of the current group: in a decode
// step (32 rows) a group's weights come from memory, and fetched by the first row block alone
// they bound it (96 bytes per k against 12 multiply-adds); spread over all the row blocks they
// arrive in time for the next group. `lines` 64-byte lines from `first`, one per `kStride` k.
struct Prefetch {
  const char* first;
  int64_t lines;
};
constexpr int64_t kStride = 2;

// x [MR, K] (row stride ldx) by NR tiles of packed weights -> y [MR, up to NR * kLanes].
template <int MR, int NR>
inline void micro_kernel(const float* x, int64_t ldx, int64_t k, const float* w,
                         int64_t tile_stride, float* y, int64_t ldy, int64_t valid_cols,
                         Prefetch ahead = {nullptr, 0}) {
  vf acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NR; ++t) acc[m][t] = vzero();
  for (int64_t kk = 0; kk < k; ++kk) {
    if (kk % kStride == 0 && kk / kStride < ahead.lines) {
      // asm volatile: GCC may drop a prefetch whose address it can prove nothing about.
      asm volatile("prefetcht0 %0" : : "m"(*(ahead.first + kk / kStride * 64)));
    }
    vf wv[NR];
    for (int t = 0; t < NR; ++t) {
      wv[t] = vload(w + t * tile_stride + kk * kLanes);
      // In a register, not folded into each multiply-add as a memory operand: GCC folds it,
      // which loads every weight vector MR times, and at two vector loads per cycle (Zen 3)
      // the loads, not the FMA units, then bound the loop (136 GFLOP/s of 202 on 2 cores).
      asm("" : "+x"(wv[t]));
    }
    for (int m = 0; m < MR; ++m) {
      const vf a = vset1(x[m * ldx + kk]);
      for (int t = 0; t < NR; ++t) acc[m][t] = vfmadd(a, wv[t], acc[m][t]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < NR; ++t) {
      const int64_t col = t * kLanes;
      if (col + kLanes <= valid_cols) {
        vstore(y + m * ldy + col, acc[m][t]);
      } else if (col < valid_cols) {
        vstore_first(y + m * ldy + col, acc[m][t], valid_cols - col);
      }
    }
  }
}

}  // namespace infercloud_vec
#endif  // INFERCLOUD_VEC_LANES
