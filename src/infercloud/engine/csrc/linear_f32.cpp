// y = x W^T for float32 x and W, W packed once, on the vector paths of vec_math.h (AVX2 with
// FMA: 8 lanes; AVX-512: 16). The float32 counterpart of linear_bf16.cpp, for CPUs where
// float32 is the fast dtype (no AVX512-BF16: bfloat16 arithmetic there is emulated).
//
// Packed layout: W [N, K] becomes [ceil(N / kLanes)][K][kLanes] float32: one vector holds one k
// of kLanes consecutive output columns; the columns past N are zero. A column tile's weights are
// one contiguous run of K vectors, read front to back.
//
// Kernel (f32_gemm.h): 4 rows of x by 3 column tiles with AVX2 (8 rows with AVX-512). A thread
// takes whole groups of 3 tiles (the work is split over N) and runs every row block of x over a
// group's weights, so that those come from memory once and from L2 for the other row blocks;
// each row block fetches a slice of the next group's weights on the way. oneDNN sums in another
// order, so the last bits can differ from F.linear's.
//
// Registered as torch.ops.infercloud.{pack_linear_f32, linear_f32, has_linear_f32}; built and
// loaded by cpu_kernels.py. Without a vector path, has_linear_f32() is false and the others
// refuse.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "f32_gemm.h"
#include "vec_math.h"

namespace {

bool has_linear_f32() {
#if defined(INFERCLOUD_VEC_LANES)
  return true;
#else
  return false;
#endif
}

#if defined(INFERCLOUD_VEC_LANES)
using namespace infercloud_vec;

// Every row of x by one group of NR tiles, fetching `next_bytes` from `next` (the following
// group's weights) on the way.
template <int NR>
void rows_by_tiles(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w,
                   int64_t tile_stride, float* y, int64_t ldy, int64_t valid_cols,
                   const float* next, int64_t next_bytes) {
  const int64_t blocks = (rows + kMR - 1) / kMR;
  const int64_t lines = (next_bytes + 63) / 64;
  const int64_t per_block = std::min((lines + blocks - 1) / blocks, (k + kStride - 1) / kStride);
  const char* next_c = reinterpret_cast<const char*>(next);
  int64_t asked = 0;  // lines asked for so far
  auto ahead = [&]() {
    const Prefetch p{next_c + asked * 64, std::max<int64_t>(0, std::min(per_block, lines - asked))};
    asked += p.lines;
    return p;
  };
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) {
    micro_kernel<kMR, NR>(x + r * ldx, ldx, k, w, tile_stride, y + r * ldy, ldy, valid_cols,
                          ahead());
  }
  // A plain switch (and an if-chain over nr below), not vec_math.h's with_count: routed through
  // its generic lambda, this GEMM fell from 177-183 to 121-129 GFLOP/s at 512 rows here.
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 0: break;
    case 1: micro_kernel<1, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
    case 2: micro_kernel<2, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
    case 3: micro_kernel<3, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
    case 4: micro_kernel<4, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
    case 5: micro_kernel<5, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
    case 6: micro_kernel<6, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
    default: micro_kernel<7, NR>(xr, ldx, k, w, tile_stride, yr, ldy, valid_cols, ahead()); break;
  }
}
#endif  // INFERCLOUD_VEC_LANES

int64_t lanes() {
#if defined(INFERCLOUD_VEC_LANES)
  return kLanes;
#else
  return 1;
#endif
}

at::Tensor pack_linear_f32(const at::Tensor& weight) {
  TORCH_CHECK(has_linear_f32(), "linear_f32: this CPU (or build) has no AVX2/FMA or AVX-512");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_f32: weight must be float32 [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), width = lanes();
  const int64_t tiles = (n + width - 1) / width;
  at::Tensor packed = at::zeros({tiles, k, width}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < width && t * width + j < n; ++j) {
        const float* row = src + (t * width + j) * k;
        for (int64_t kk = 0; kk < k; ++kk) dst[(t * k + kk) * width + j] = row[kk];
      }
    }
  });
  return packed;
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(has_linear_f32(), "linear_f32: this CPU (or build) has no AVX2/FMA or AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear_f32: x must be float32 [rows, in_features], rows dense");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == lanes(),
              "linear_f32: packed must come from pack_linear_f32 on this CPU");
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "linear_f32: in_features of x and the weight differ");
  TORCH_CHECK(out_features > (tiles - 1) * lanes() && out_features <= tiles * lanes(),
              "linear_f32: out_features does not match the packed weight");
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
#if defined(INFERCLOUD_VEC_LANES)
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), tile_stride = k * kLanes;
  const int64_t groups = (tiles + kNR - 1) / kNR;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first_tile = g * kNR;
      const int64_t nr = std::min(kNR, tiles - first_tile);
      const int64_t col = first_tile * kLanes;
      const int64_t valid = std::min(nr * kLanes, out_features - col);
      const float* w = wp + first_tile * tile_stride;
      // The next group this thread runs (groups are consecutive in memory); none after its last.
      const float* next = w + nr * tile_stride;
      const int64_t next_tiles = g + 1 < end ? std::min(kNR, tiles - first_tile - nr) : 0;
      const int64_t next_bytes = next_tiles * tile_stride * static_cast<int64_t>(sizeof(float));
      if (nr == 3) {
        rows_by_tiles<3>(xp, ldx, rows, k, w, tile_stride, yp + col, out_features, valid, next,
                         next_bytes);
      } else if (nr == 2) {
        rows_by_tiles<2>(xp, ldx, rows, k, w, tile_stride, yp + col, out_features, valid, next,
                         next_bytes);
      } else {
        rows_by_tiles<1>(xp, ldx, rows, k, w, tile_stride, yp + col, out_features, valid, next,
                         next_bytes);
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) {
  m.def("has_linear_f32() -> bool", &has_linear_f32);
  m.def("pack_linear_f32(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(infercloud, CPU, m) {
  m.impl("pack_linear_f32", &pack_linear_f32);
  m.impl("linear_f32", &linear_f32);
}
