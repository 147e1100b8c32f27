// Writing a step's new keys and values into tiled caches (kv_layout.h), for the Python layer
// loop; the decoder stack (decoder_stack.cpp) writes through the same function.
//
// Registered as torch.ops.infercloud.write_kv_tiled; built and loaded by cpu_kernels.py.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "kv_layout.h"

namespace {

// k, v [tokens, num_kv_heads, head_dim] (rows may be strided, head_dim dense); write_rows int64
// [num_kv_heads * tokens], head major: the cache row (block row * 16 + slot) of each.
void write_kv_tiled(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& write_rows) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.size(1) == infercloud_kv::kTiledBlock,
              "write_kv_tiled: caches must be contiguous bfloat16 [rows, 16, head_dim]");
  const int64_t head_dim = k_cache.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "write_kv_tiled: head_dim must be even");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(2) == head_dim &&
                  k.stride(2) == 1 && v.stride(2) == 1 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "write_kv_tiled: k and v must be bfloat16 [tokens, num_kv_heads, head_dim]");
  const int64_t tokens = k.size(0), heads = k.size(1);
  TORCH_CHECK(write_rows.scalar_type() == at::kLong && write_rows.is_contiguous() &&
                  write_rows.numel() == heads * tokens,
              "write_kv_tiled: write_rows must be int64 [num_kv_heads * tokens]");
  const int64_t cache_rows = k_cache.size(0) * infercloud_kv::kTiledBlock;
  const int64_t* rows = write_rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < write_rows.numel(); ++j) {
    TORCH_CHECK(rows[j] >= 0 && rows[j] < cache_rows, "write_kv_tiled: write row ", rows[j],
                " is not in [0, ", cache_rows, ")");
  }
  infercloud_kv::write_rows_tiled(k_cache.data_ptr<c10::BFloat16>(),
                                  v_cache.data_ptr<c10::BFloat16>(), rows, tokens, heads, head_dim,
                                  k.data_ptr<c10::BFloat16>(), k.stride(0), k.stride(1),
                                  v.data_ptr<c10::BFloat16>(), v.stride(0), v.stride(1));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) {
  m.def(
      "write_kv_tiled(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
      "Tensor write_rows) -> ()");
}

TORCH_LIBRARY_IMPL(infercloud, CPU, m) { m.impl("write_kv_tiled", &write_kv_tiled); }
