// A Llama-family model's decoder layers in one call from Python, for CPU steps that run every
// part on our kernels: bfloat16 linear layers (linear_bf16.cpp; gate, up and SiLU in one
// GEMM), the fused element-wise ops (layer_ops.cpp), decode attention (paged_attention.cpp)
// and prefill attention (prefill_attention.cpp).
//
// The Python layer loop (llama.py, `_layers_fused`) makes about 20 operator calls per layer, each
// with its Python dispatch, views and a few small tensors; at 30 layers that was several
// milliseconds of a 40 ms decode step on a 2-core Xeon. Here the same operators run in the same
// order on the same inputs, called through torch's dispatcher, so the results are the same bits
// as the Python loop's. Two things are done directly: the new keys and values are copied into
// their cache rows (what `index_copy_` of the transposed k and v does, or, for tiled caches,
// `write_kv_tiled`: the same `write_rows_tiled`, kv_layout.h), and a step with only
// decodes (or only prefill chunks) takes the attention kernel's output as the layer's
// attention output instead of copying it into a larger tensor.
//
// The stack holds its layers' weights and KV caches (the same storage as the model's: nothing
// is copied); `forward` takes one step's tokens and attention metadata. Rows 0 .. num_decode-1
// are decodes, rows num_decode .. are the step's prefill chunks, as the model runner lays
// them out. Registered as the TorchScript class torch.classes.infercloud.DecoderStack.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_layout.h"

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>
      linear = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>(
          "infercloud::linear_bf16");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("infercloud::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm =
          find_op<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
              "infercloud::add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      rotary = find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&)>("infercloud::rotary_embedding_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>
      linear_silu = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>(
          "infercloud::linear_silu_bf16");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, int64_t, bool,
                                      bool)>
      decode_attention =
          find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, int64_t, bool, bool)>(
              "infercloud::paged_decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, int64_t, bool, bool)>
      prefill_attention =
          find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             int64_t, bool, bool)>("infercloud::paged_prefill_attention");
};

const Ops& ops() {
  static const Ops instance;  // looked up once: every operator is registered by then
  return instance;
}

struct Layer {
  at::Tensor input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
               int64_t intermediate_size, double eps, double scale, bool use_tiles, bool tiled_kv,
               bool attention_tiles)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        hidden_size_(hidden_size),
        intermediate_size_(intermediate_size),
        eps_(eps),
        scale_(scale),
        use_tiles_(use_tiles),
        tiled_kv_(tiled_kv),
        attention_tiles_(attention_tiles) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                    head_dim > 0 && hidden_size > 0 && intermediate_size > 0,
                "DecoderStack: bad model dimensions");
  }

  // Weights packed by pack_linear_bf16 (gate_up: [gate; up], its tiles then reordered by
  // interleave_gate_up, for linear_silu_bf16); k_cache and v_cache [num_kv_heads * num_blocks,
  // block_size, head_dim], the model runner's, in the tiled layout (kv_layout.h) if the stack
  // was made with tiled_kv.
  void add_layer(at::Tensor input_norm, at::Tensor qkv, at::Tensor o, at::Tensor post_norm,
                 at::Tensor gate_up, at::Tensor down, at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(layers_.empty() || k_cache.sizes() == layers_[0].k_cache.sizes(),
                "DecoderStack: every layer's cache must have the same shape");
    TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 3 &&
                    k_cache.size(2) == head_dim_ && k_cache.is_contiguous() &&
                    v_cache.is_contiguous(),
                "DecoderStack: k_cache and v_cache must be contiguous [rows, block, head_dim]");
    TORCH_CHECK(!tiled_kv_ || (k_cache.size(1) == infercloud_kv::kTiledBlock &&
                               k_cache.scalar_type() == at::kBFloat16),
                "DecoderStack: tiled caches are bfloat16 in blocks of 16");
    layers_.push_back(Layer{std::move(input_norm), std::move(qkv), std::move(o),
                            std::move(post_norm), std::move(gate_up), std::move(down),
                            std::move(k_cache), std::move(v_cache)});
  }

  // hidden [T, hidden_size] (updated in place: the residual stream after the last layer);
  // positions int64 [T]; write_rows int64 [num_kv_heads * T], head major (the cache row of each
  // new key and value); decode_* for rows 0 .. num_decode-1 (empty when none), prefill_* for
  // rows num_decode .. T-1 (empty when none).
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     at::Tensor write_rows, int64_t num_decode, at::Tensor decode_block_tables,
                     at::Tensor decode_context_lens, at::Tensor prefill_block_tables,
                     at::Tensor prefill_starts, at::Tensor prefill_lens) {
    const int64_t tokens = hidden.size(0);
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size_ && hidden.is_contiguous(),
                "DecoderStack.forward: hidden must be contiguous [tokens, hidden_size]");
    TORCH_CHECK(num_decode >= 0 && num_decode <= tokens, "DecoderStack.forward: bad num_decode");
    TORCH_CHECK(write_rows.scalar_type() == at::kLong && write_rows.is_contiguous() &&
                    write_rows.numel() == num_kv_heads_ * tokens,
                "DecoderStack.forward: write_rows must be int64 [num_kv_heads * tokens]");
    if (!layers_.empty()) {  // every layer's cache has the first one's shape (one pool)
      const int64_t cache_rows = layers_[0].k_cache.size(0) * layers_[0].k_cache.size(1);
      const int64_t* rows = write_rows.data_ptr<int64_t>();
      for (int64_t j = 0; j < write_rows.numel(); ++j) {
        TORCH_CHECK(rows[j] >= 0 && rows[j] < cache_rows, "DecoderStack: write row ", rows[j],
                    " is not in [0, ", cache_rows, ")");
      }
    }
    const int64_t num_prefill = tokens - num_decode;
    const Ops& op = ops();
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_size = q_size + 2 * kv_size;
    at::Tensor delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      Layer& layer = layers_[i];
      at::Tensor x = i == 0 ? op.rms_norm.call(hidden, layer.input_norm, eps_)
                            : op.add_rms_norm.call(hidden, delta, layer.input_norm, eps_);
      const at::Tensor qkv = op.linear.call(x, layer.qkv, qkv_size, use_tiles_);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      op.rotary.call(q, k, positions, cos, sin);
      write_kv(qkv, q_size, write_rows, layer);
      const int64_t num_blocks = layer.k_cache.size(0) / num_kv_heads_;
      at::Tensor attention;
      if (num_prefill == 0 || num_decode == 0) {
        attention = num_decode > 0 ? decode(q, num_decode, layer, decode_block_tables,
                                            decode_context_lens, num_blocks)
                                   : prefill(q, 0, tokens, layer, prefill_block_tables,
                                             prefill_starts, prefill_lens, num_blocks);
      } else {
        attention = at::empty({tokens, q_size}, hidden.options());
        attention.narrow(0, 0, num_decode)
            .copy_(decode(q, num_decode, layer, decode_block_tables, decode_context_lens,
                          num_blocks));
        attention.narrow(0, num_decode, num_prefill)
            .copy_(prefill(q, num_decode, num_prefill, layer, prefill_block_tables,
                           prefill_starts, prefill_lens, num_blocks));
      }
      delta = op.linear.call(attention, layer.o, hidden_size_, use_tiles_);
      x = op.add_rms_norm.call(hidden, delta, layer.post_norm, eps_);
      const at::Tensor activated =
          op.linear_silu.call(x, layer.gate_up, intermediate_size_, use_tiles_);
      delta = op.linear.call(activated, layer.down, hidden_size_, use_tiles_);
    }
    if (delta.defined()) hidden.add_(delta);
    return hidden;
  }

 private:
  // k and v of token t, head h, go to cache row write_rows[h * tokens + t].
  void write_kv(const at::Tensor& qkv, int64_t q_size, const at::Tensor& write_rows,
                Layer& layer) const {
    const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0);
    const int64_t kv_size = num_kv_heads_ * head_dim_;
    const int64_t* rows = write_rows.data_ptr<int64_t>();  // checked by forward
    if (tiled_kv_) {
      const auto* k = static_cast<const c10::BFloat16*>(qkv.data_ptr()) + q_size;
      infercloud_kv::write_rows_tiled(layer.k_cache.data_ptr<c10::BFloat16>(),
                                      layer.v_cache.data_ptr<c10::BFloat16>(), rows, tokens,
                                      num_kv_heads_, head_dim_, k, row_stride, head_dim_,
                                      k + kv_size, row_stride, head_dim_);
      return;
    }
    const size_t bytes = head_dim_ * qkv.element_size();
    const char* src = static_cast<const char*>(qkv.data_ptr());
    char* k_dst = static_cast<char*>(layer.k_cache.data_ptr());
    char* v_dst = static_cast<char*>(layer.v_cache.data_ptr());
    const int64_t element = qkv.element_size();
    for (int64_t h = 0; h < num_kv_heads_; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t row = rows[h * tokens + t];
        const char* k_src = src + (t * row_stride + q_size + h * head_dim_) * element;
        std::memcpy(k_dst + row * bytes, k_src, bytes);
        std::memcpy(v_dst + row * bytes, k_src + kv_size * element, bytes);
      }
    }
  }

  at::Tensor decode(const at::Tensor& q, int64_t rows, const Layer& layer,
                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                    int64_t num_blocks) const {
    const at::Tensor out = ops().decode_attention.call(
        q.narrow(0, 0, rows), layer.k_cache, layer.v_cache, block_tables,
        context_lens, scale_, num_blocks, tiled_kv_, attention_tiles_);
    return out.view({rows, num_heads_ * head_dim_});
  }

  at::Tensor prefill(const at::Tensor& q, int64_t start, int64_t rows, const Layer& layer,
                     const at::Tensor& block_tables, const at::Tensor& starts,
                     const at::Tensor& lens, int64_t num_blocks) const {
    const at::Tensor out = ops().prefill_attention.call(
        q.narrow(0, start, rows).contiguous(), layer.k_cache, layer.v_cache, block_tables,
        starts, lens, scale_, num_blocks, tiled_kv_, attention_tiles_);
    return out.view({rows, num_heads_ * head_dim_});
  }

  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  double eps_, scale_;
  bool use_tiles_;
  bool tiled_kv_;  // the caches are in the tiled layout (kv_layout.h)
  bool attention_tiles_;  // both attentions on the AMX tile unit (the kernels' tile_unit)
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool, bool,
                            bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward);
}
