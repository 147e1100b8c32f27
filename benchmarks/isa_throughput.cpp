// Peak throughput of one core's AVX-512 units: 16 independent chains of vdpbf16ps (the
// instruction our vdpbf16ps GEMM and attention kernels are built on) and of vfmadd231ps on zmm
// registers, so that latency does not bound either. Tells whether a machine's AVX-512 path or
// its AMX tile unit should carry the bfloat16 work.
//
// The chains are unrolled by pragma: without it GCC 12 at -O2 kept acc[] in memory and ran one
// vdpbf16ps per loop turn, so every chain waited on a store and a reload (the figures this
// printed before 2026-12-06's fix, 69 and 47 GFLOP/s on an AMX Xeon and 180-196 and 77 on an
// EPYC, measured that, not the units).
//
//     g++ -O2 -march=native benchmarks/isa_throughput.cpp -o /tmp/isa && /tmp/isa
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr int kChains = 16;
  constexpr long kRounds = 200000000;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < kRounds; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    asm volatile("" : "+v"(a));  // keeps the loop from being folded
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0;
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("vdpbf16ps zmm: %.2f G/s, %.0f GFLOP/s per core\n", kRounds * kChains / seconds / 1e9,
              kRounds * kChains * 64.0 / seconds / 1e9);

  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
  __m512 x = _mm512_set1_ps(0.5f);
  const __m512 y = _mm512_set1_ps(0.25f);
  start = std::chrono::steady_clock::now();
  for (long i = 0; i < kRounds; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], x, y);
    asm volatile("" : "+v"(x));
  }
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("vfmadd231ps zmm: %.2f G/s, %.0f GFLOP/s per core (%g)\n",
              kRounds * kChains / seconds / 1e9, kRounds * kChains * 32.0 / seconds / 1e9,
              static_cast<double>(sink > 0));
  return 0;
}
