// Vector helpers shared by the CPU kernels, in the widest form the build target has (the kernels
// are built with -march=native):
//
//   AVX-512 (__AVX512F__):           16 float32 lanes, `vf` = __m512;
//   AVX2 with FMA and F16C:           8 float32 lanes, `vf` = __m256.
//
// Where either is present INFERCLOUD_VEC_LANES is defined (16 or 8) and `infercloud_vec` holds:
// vload / vstore from and to float32, bfloat16 and float16 memory (bfloat16 stores round to
// nearest even, NaN to the quiet NaN 0x7FC0, as c10 does; with AVX512-BF16 in one instruction,
// vcvtneps2bf16, which also flushes denormal inputs to zero and keeps a NaN's payload); vload_first / vstore_first, which
// touch only the first n lanes (0 <= n <= kLanes; the rest load as zero and are not written);
// vkeep_first, which zeroes the lanes from n on; the arithmetic a kernel needs; vsum / vpeak (the
// sum and maximum of the lanes); vsum_each (kLanes vectors' sums, one per lane); vexp;
// exp_and_inv_sum, a softmax's numerators; and with_count, from a run-time count to a template. A kernel written on these runs at either width; each
// keeps a scalar path for other CPUs.
// load16 / store16 / exp16 name the AVX-512 forms that the bfloat16-only kernels (vdpbf16ps,
// AMX) use directly.
#pragma once

#if defined(__AVX512F__)
#define INFERCLOUD_VEC_LANES 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INFERCLOUD_VEC_LANES 8
#endif

#if defined(INFERCLOUD_VEC_LANES)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace infercloud_vec {

constexpr int kLanes = INFERCLOUD_VEC_LANES;

// Cephes' expf polynomial for e^r, r in [-ln2/2, ln2/2] (about 1 ulp), shared by both widths.
constexpr float kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f;
constexpr float kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if INFERCLOUD_VEC_LANES == 16
using vf = __m512;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
#if defined(__AVX512BF16__)
  // One instruction, round to nearest even as below, except that denormal inputs become zero
  // (bfloat16 denormals, below 1.2e-38, do not occur in activations) and a NaN keeps its payload.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
  return;
#endif
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_srli_epi32(rounded, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x in [-87, 88] (clamped outside): 2^n * e^r, scaled by vscalefps.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

template <typename T>
inline vf vload(const T* p) {
  return load16(p);
}
template <typename T>
inline void vstore(T* p, vf x) {
  store16(p, x);
}
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline vf vload_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline void vstore_first(float* p, vf x, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
inline vf vkeep_first(vf x, int64_t n) { return _mm512_maskz_mov_ps(first_lanes(n), x); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vpeak(vf x) { return _mm512_reduce_max_ps(x); }
inline vf vexp(vf x) { return exp16(x); }
// r[k] = the sum of a[k]'s 16 lanes, for 16 vectors: halves, then 128-bit quarters, then lanes
// are folded pairwise (about 3 operations per vector instead of a full reduction each).
inline vf vsum_each(const vf (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  // c[i]'s 128-bit quarter j holds 4 partial sums of a[4i + j].
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  // Lane 4j + l of r holds a[4l + j]: put a[k] in lane k.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

#else  // 8 lanes: AVX2, FMA, F16C
using vf = __m256;

template <typename T>
inline vf vload(const T* p);
template <>
inline vf vload(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline vf vload(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
template <>
inline vf vload(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline void vstore(c10::BFloat16* p, vf x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  rounded = _mm256_srli_epi32(rounded, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Eight 32-bit values (each < 2^16) to eight 16-bit ones: pack within each 128-bit half,
  // then bring the two halves' low quadwords together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void vstore(c10::Half* p, vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vload_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first_lanes(n)); }
inline void vstore_first(float* p, vf x, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), x); }
inline vf vkeep_first(vf x, int64_t n) {
  return _mm256_and_ps(x, _mm256_castsi256_ps(first_lanes(n)));
}
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vpeak(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// exp(x) for x in [-87, 88] (clamped outside): 2^n * e^r, 2^n built in the exponent field
// (n + 127 stays in [1, 254] over the clamped range).
inline vf vexp(vf x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
// r[k] = the sum of a[k]'s 8 lanes, for 8 vectors: two rounds of pairwise horizontal adds
// within 128-bit halves, then the halves added across (9 operations for the 8 sums).
inline vf vsum_each(const vf (&a)[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // u0 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], u1 the same for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// Softmax numerators in place, exp(s[t] - max), and 1 / their sum, over `count` >= 1 scores.
inline float exp_and_inv_sum(float* s, int64_t count) {
  vf peak_v = vset1(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= count; t += kLanes) peak_v = vmax(peak_v, vload(s + t));
  float peak = vpeak(peak_v);
  for (; t < count; ++t) peak = std::max(peak, s[t]);
  const vf peak_all = vset1(peak);
  vf sum_v = vzero();
  for (t = 0; t + kLanes <= count; t += kLanes) {
    const vf e = vexp(vsub(vload(s + t), peak_all));
    vstore(s + t, e);
    sum_v = vadd(sum_v, e);
  }
  if (t < count) {
    const vf e = vkeep_first(vexp(vsub(vload_first(s + t, count - t), peak_all)), count - t);
    vstore_first(s + t, e, count - t);
    sum_v = vadd(sum_v, e);
  }
  return 1.0f / vsum(sum_v);
}

// fn(std::integral_constant<int, n>{}) for a count n in [1, kMax] known only at run time: how a
// kernel templated on its row or tile count (so that its accumulators live in registers) is
// reached; nothing happens for n outside that range.
template <int kMax, typename Fn>
inline void with_count(int64_t n, Fn&& fn) {
  if constexpr (kMax >= 1) {
    if (n == kMax) {
      fn(std::integral_constant<int, kMax>{});
    } else {
      with_count<kMax - 1>(n, std::forward<Fn>(fn));
    }
  }
}

// x rounded to T and read back: the value a torch op producing T hands to the next op.
template <typename T>
inline vf vround(vf x) {
  alignas(64) T buf[kLanes];
  vstore(buf, x);
  return vload(static_cast<const T*>(buf));
}
template <>
inline vf vround<float>(vf x) {
  return x;
}
#if defined(__AVX512BF16__)
template <>
inline vf vround<c10::BFloat16>(vf x) {  // store16's rounding, without the trip through memory
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

}  // namespace infercloud_vec

#endif  // INFERCLOUD_VEC_LANES
