// What one core's AMX tile unit delivers, and what feeding it costs: tdpbf16ps (16 x 16 x 32
// bfloat16 products into float32, 32,768 flops) on tiles already loaded, then the 2 x 2 block our
// GEMM runs (csrc/linear_bf16.cpp: two A tiles, two B tiles, four products per k step) with its
// four one-kilobyte tile loads per step taken from buffers of growing size, so from L1, L2 and
// beyond. The gap between the lines is what a GEMM loses where its operands are not in L1.
//
//     g++ -O2 -march=native benchmarks/amx_throughput.cpp -o /tmp/amx && /tmp/amx
//
// Needs AMX-BF16 and a Linux that grants the tile data state (arch_prctl).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../src/infercloud/engine/csrc/amx.h"

#if !defined(INFERCLOUD_AMX)
#error "build on a CPU with AMX-BF16 (-march=native): this measures its tile unit"
#endif

namespace {

infercloud_amx::TileConfig config;  // static storage: see amx.h on GCC and ldtilecfg

constexpr double kFlopsPerProduct = 16.0 * 16.0 * 32.0 * 2.0;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main() {
  if (!infercloud_amx::tiles_available()) {
    std::puts("the kernel does not grant this process the AMX tile state");
    return 1;
  }
  for (int t = 0; t < 8; ++t) config.set(t, 16, 64);
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);

  constexpr long kSteps = 5000000;  // four products each
  auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < kSteps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  double s = seconds_since(start);
  std::printf("tdpbf16ps on loaded tiles: %.1f ns per product, %.0f GFLOP/s\n",
              s / (4.0 * kSteps) * 1e9, 4.0 * kSteps * kFlopsPerProduct / s / 1e9);

  for (size_t kilobytes : {16, 256, 1536, 8192, 65536}) {
    const size_t tiles = kilobytes;  // one kilobyte each
    std::vector<uint16_t> buffer(tiles * 512 + 32, 0x3f80);
    const char* base = reinterpret_cast<const char*>(
        (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~static_cast<uintptr_t>(63));
    size_t next = 0;
    start = std::chrono::steady_clock::now();
    for (long i = 0; i < kSteps; ++i) {
      _tile_loadd(4, base + (next % tiles) * 1024, 64);
      _tile_loadd(5, base + ((next + 1) % tiles) * 1024, 64);
      _tile_loadd(6, base + ((next + 2) % tiles) * 1024, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(7, base + ((next + 3) % tiles) * 1024, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
      next += 4;
    }
    s = seconds_since(start);
    std::printf("2 x 2 block, its 4 tile loads from %6zu KB: %5.1f ns per product, %5.0f GFLOP/s\n",
                kilobytes, s / (4.0 * kSteps) * 1e9, 4.0 * kSteps * kFlopsPerProduct / s / 1e9);
  }
  _tile_release();
  return 0;
}
