// Greedy sampling's choice for every row of logits (float32, or bfloat16 as the model's
// vocabulary projection writes them: each value widened exactly, so the same index as on the
// float32 copy, without making the copy): the index of the row's maximum,
// with torch's tie and NaN rules (`logits.max(dim=-1).indices`): the first of equal maxima
// wins, a NaN beats every number (the first NaN wins), and a row of -inf gives 0.
//
// aten's max over 32 rows of 49152 took 0.89 ms of a ~21 ms decode step on a 2-core EPYC, this
// 0.13 ms (hot, outside the engine: 0.41 vs 0.11 ms): the rows are split over the threads and
// each is scanned 16 lanes at a time (8 with AVX2).
//
// Registered as torch.ops.infercloud.greedy_tokens; built and loaded by cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

#if defined(INFERCLOUD_VEC_LANES)
#include <immintrin.h>

#include <algorithm>
#endif

namespace {

template <typename T>
int64_t scalar_argmax(const T* row, int64_t begin, int64_t end, int64_t best, float peak) {
  for (int64_t i = begin; i < end; ++i) {
    const float x = static_cast<float>(row[i]);
    if (std::isnan(x)) return i;
    if (x > peak) {
      peak = x;
      best = i;
    }
  }
  return best;
}

template <typename T>
int64_t row_argmax(const T* row, int64_t width) {
#if INFERCLOUD_VEC_LANES == 16
  if (width >= 16) {
    // Per lane: the largest value seen and the first index holding it (a later equal value
    // does not replace it: the comparison is strict).
    __m512 peak = infercloud_vec::vload(row);
    __m512i best = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 nan = _mm512_cmp_ps_mask(peak, peak, _CMP_UNORD_Q);
    __m512i index = best;
    const __m512i step = _mm512_set1_epi32(16);
    int64_t i = 16;
    for (; i + 16 <= width && nan == 0; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 x = infercloud_vec::vload(row + i);
      nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(x, peak, _CMP_GT_OQ);
      peak = _mm512_mask_mov_ps(peak, greater, x);
      best = _mm512_mask_mov_epi32(best, greater, index);
    }
    if (nan != 0) return scalar_argmax(row, 0, width, 0, -INFINITY);  // the first NaN wins
    // Across lanes: the largest value, then the smallest index among the lanes holding it.
    const float top = _mm512_reduce_max_ps(peak);
    const __mmask16 holders = _mm512_cmp_ps_mask(peak, _mm512_set1_ps(top), _CMP_EQ_OQ);
    const int64_t first = _mm512_mask_reduce_min_epi32(holders, best);
    return scalar_argmax(row, i, width, first, top);
  }
#elif INFERCLOUD_VEC_LANES == 8
  if (width >= 8) {
    // The same scan, 8 lanes at a time, with comparison masks and blends.
    __m256 peak = infercloud_vec::vload(row);
    __m256i best = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int nan = _mm256_movemask_ps(_mm256_cmp_ps(peak, peak, _CMP_UNORD_Q));
    __m256i index = best;
    const __m256i step = _mm256_set1_epi32(8);
    int64_t i = 8;
    for (; i + 8 <= width && nan == 0; i += 8) {
      index = _mm256_add_epi32(index, step);
      const __m256 x = infercloud_vec::vload(row + i);
      nan = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      const __m256 greater = _mm256_cmp_ps(x, peak, _CMP_GT_OQ);
      peak = _mm256_blendv_ps(peak, x, greater);
      best = _mm256_blendv_epi8(best, index, _mm256_castps_si256(greater));
    }
    if (nan != 0) return scalar_argmax(row, 0, width, 0, -INFINITY);  // the first NaN wins
    alignas(32) float peaks[8];
    alignas(32) int32_t bests[8];
    _mm256_store_ps(peaks, peak);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bests), best);
    float top = peaks[0];
    for (int l = 1; l < 8; ++l) top = std::max(top, peaks[l]);
    int64_t first = width;
    for (int l = 0; l < 8; ++l) {
      if (peaks[l] == top) first = std::min<int64_t>(first, bests[l]);
    }
    return scalar_argmax(row, i, width, first, top);
  }
#endif
  if (width == 0) return 0;
  const float first = static_cast<float>(row[0]);
  if (std::isnan(first)) return 0;
  return scalar_argmax(row, 1, width, 0, first);
}

template <typename T>
void argmax_rows(const at::Tensor& logits, int64_t* chosen) {
  const int64_t rows = logits.size(0), width = logits.size(1);
  const T* data = logits.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) chosen[r] = row_argmax(data + r * width, width);
  });
}

at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "greedy_tokens: logits must be contiguous float32 or bfloat16 [rows, vocab]");
  TORCH_CHECK(logits.size(1) > 0, "greedy_tokens: empty vocabulary");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat) {
    argmax_rows<float>(logits, out.data_ptr<int64_t>());
  } else {
    argmax_rows<c10::BFloat16>(logits, out.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) { m.def("greedy_tokens(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(infercloud, CPU, m) { m.impl("greedy_tokens", &greedy_tokens); }
