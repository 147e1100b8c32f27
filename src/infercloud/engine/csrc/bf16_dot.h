// The inner loop shared by our bfloat16 matrix products (linear_bf16.cpp, prefill_attention.cpp):
// MR rows of x times NR packed column tiles with vdpbf16ps, accumulated in float32.
//
// Packed tiles: column tile t holds `pairs` vectors of 64 bytes; vector p holds, for each of
// its 16 columns j, the two values at k = 2p and 2p + 1 (column j's lane: k = 2p low, 2p + 1
// high). x rows are bfloat16 with k contiguous, so one 32-bit load broadcast gives a pair.
// Only compiled where the target has AVX512-BF16.
#pragma once

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace infercloud_vec {

// acc[m][t] += sum over p < pairs of x[m][2p..2p+1] . tile t's vector p. `prefetch_pairs` > 0
// asks for each tile's line that many pairs ahead (tiles streamed from memory). `side`, where
// given, is a tile of `pairs` 64-byte lines that the caller will read next: iteration p asks
// for its line p into L2, so that a later pass finds the tile there.
template <int MR, int NR>
inline void dot_pairs(const c10::BFloat16* x, int64_t ldx, int64_t pairs,
                      const c10::BFloat16* tiles, int64_t tile_stride, int64_t prefetch_pairs,
                      __m512 (&acc)[MR][NR], const c10::BFloat16* side = nullptr) {
  const int32_t* xp[MR];
  for (int m = 0; m < MR; ++m) xp[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  for (int64_t p = 0; p < pairs; ++p) {
    if (side != nullptr) __builtin_prefetch(side + p * 32, 0, 2);
    __m512bh w[NR];
    for (int t = 0; t < NR; ++t) {
      const c10::BFloat16* wt = tiles + t * tile_stride + p * 32;
      if (prefetch_pairs > 0) __builtin_prefetch(wt + prefetch_pairs * 32, 0, 3);
      w[t] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(wt)));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[m][p]));
      for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, w[t]);
    }
  }
}

}  // namespace infercloud_vec

#endif  // __AVX512BF16__
