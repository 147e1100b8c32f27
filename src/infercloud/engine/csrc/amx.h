// The AMX tile unit, shared by the kernels that use it (linear_bf16.cpp, paged_attention.cpp):
// whether this process may use it, and the tile configuration record that ldtilecfg reads.
//
// INFERCLOUD_AMX is defined where the build targets AVX512-BF16, AMX-TILE and AMX-BF16 (the
// kernels are built with -march=native). Even then Linux hands a process the tile data state
// only on request; `tiles_available()` asks once per process, and a kernel without AMX support
// refuses, so every tile path checks it first.
#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFERCLOUD_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace infercloud_amx {

// ldtilecfg's operand (palette 1): per tile register, its rows and its bytes per row. Kept in
// static storage by its users: GCC 12 does not see that ldtilecfg reads its operand, and it
// dropped the stores that filled a local one (the load then faulted).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int rows_, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

}  // namespace infercloud_amx
#endif

namespace infercloud_amx {

// Whether the tile paths can run in this process: built for AMX-BF16, and Linux has granted the
// tile data state (asked once; inline, so one answer per process: the kernels share one shared
// object). False on other builds.
inline bool tiles_available() {
#if defined(INFERCLOUD_AMX)
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

}  // namespace infercloud_amx
