// The element-wise parts of a Llama layer, each fused into one pass over its rows, for the CPU:
// RMSNorm (optionally after the residual add), rotary embedding in place, SiLU(gate) * up.
//
// Each op reproduces the rounding of the plain-torch code it replaces (llama.py): arithmetic in
// float32, results rounded to the tensor's dtype at the same points (e.g. RMSNorm rounds the
// normalised row to the dtype before multiplying by the weight, as the reference does). No
// multiply-add contraction (ISO C++ mode: -ffp-contract=off), so float32 sums and products
// round as torch's separate ops do; reductions (the mean of squares) may sum in another order.
// One known departure: with AVX512-BF16 the rounding to bfloat16 flushes denormal inputs to
// zero (vec_math.h's store16).
//
// Registered as torch.ops.infercloud.{rms_norm, add_rms_norm, rotary_embedding_, silu_and_mul,
// vector_lanes};
// built and loaded by cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline float load(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T store(float x);
template <>
inline float store<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 store<c10::BFloat16>(float x) {
  // Round to nearest even, as c10 does (NaN stays NaN).
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = std::isnan(x) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  return out;
}
template <>
inline c10::Half store<c10::Half>(float x) {
  return c10::Half(x);
}

// Rounded to T and read back: the value a torch op producing T would hand to the next op.
template <typename T>
inline float round_to(float x) {
  return load(store<T>(x));
}

#define DISPATCH_FLOATING(dtype, name, ...)                      \
  switch (dtype) {                                               \
    case at::kFloat: {                                           \
      using scalar_t = float;                                    \
      __VA_ARGS__();                                             \
      break;                                                     \
    }                                                            \
    case at::kBFloat16: {                                        \
      using scalar_t = c10::BFloat16;                            \
      __VA_ARGS__();                                             \
      break;                                                     \
    }                                                            \
    case at::kHalf: {                                            \
      using scalar_t = c10::Half;                                \
      __VA_ARGS__();                                             \
      break;                                                     \
    }                                                            \
    default:                                                     \
      TORCH_CHECK(false, name, ": unsupported dtype ", dtype);   \
  }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, width], rows dense");
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)); if residual is given, first
// residual = round(residual + x) in place and normalise that. With AVX-512 or AVX2, kLanes at a
// time (the sum of squares then adds in kLanes partial sums: another order than one running sum).
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* w = weight.data_ptr<T>();
#if defined(INFERCLOUD_VEC_LANES)
  using namespace infercloud_vec;
  const int64_t vec_width = width - width % kLanes;  // the rest goes through the scalar tails
#else
  const int64_t vec_width = 0;
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x.data_ptr<T>() + r * x.stride(0);
      const T* src = xr;
      T* o = out.data_ptr<T>() + r * out.stride(0);
      if (residual != nullptr) {
        T* res = residual->data_ptr<T>() + r * residual->stride(0);
        int64_t i = 0;
#if defined(INFERCLOUD_VEC_LANES)
        for (; i < vec_width; i += kLanes) {
          vstore(res + i, vadd(vload(static_cast<const T*>(res + i)), vload(xr + i)));
        }
#endif
        for (; i < width; ++i) res[i] = store<T>(load(res[i]) + load(xr[i]));
        src = res;
      }
      float sum = 0.f;
      int64_t i = 0;
#if defined(INFERCLOUD_VEC_LANES)
      vf sum_v = vzero();
      for (; i < vec_width; i += kLanes) {
        const vf v = vload(src + i);
        sum_v = vadd(sum_v, vmul(v, v));
      }
      sum = vsum(sum_v);
#endif
      for (; i < width; ++i) {
        const float v = load(src[i]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + static_cast<float>(eps));
      i = 0;
#if defined(INFERCLOUD_VEC_LANES)
      const vf inv_v = vset1(inv);
      for (; i < vec_width; i += kLanes) {
        const vf normed = vround<T>(vmul(vload(src + i), inv_v));
        vstore(o + i, vmul(vload(w + i), normed));
      }
#endif
      for (; i < width; ++i) {
        o[i] = store<T>(load(w[i]) * round_to<T>(load(src[i]) * inv));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [width] of x's dtype");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  DISPATCH_FLOATING(x.scalar_type(), "rms_norm",
                    [&] { rms_norm_rows<scalar_t>(x, nullptr, weight, eps, out); });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual and x differ in shape or dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be contiguous [width] of x's dtype");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  DISPATCH_FLOATING(x.scalar_type(), "add_rms_norm",
                    [&] { rms_norm_rows<scalar_t>(x, &residual, weight, eps, out); });
  return out;
}

// x [tokens, heads, head_dim] (rows may be strided, heads and dims dense), rotated in place by
// position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of head_dim ("rotate half").
template <typename T>
void rotate_rows(at::Tensor& x, const int64_t* positions, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_p + positions[t] * half;
      const float* s = sin_p + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x.data_ptr<T>() + t * x.stride(0) + h * x.stride(1);
        int64_t i = 0;
#if defined(INFERCLOUD_VEC_LANES)
        using namespace infercloud_vec;
        for (; i + kLanes <= half; i += kLanes) {
          const vf x1 = vload(static_cast<const T*>(row + i));
          const vf x2 = vload(static_cast<const T*>(row + i + half));
          const vf cv = vload(c + i), sv = vload(s + i);
          vstore(row + i, vsub(vmul(x1, cv), vmul(x2, sv)));
          vstore(row + i + half, vadd(vmul(x2, cv), vmul(x1, sv)));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = load(row[i]), x2 = load(row[i + half]);
          const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
          row[i] = store<T>(a - b);
          row[i + half] = store<T>(d + e);
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                       const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2),
                "rotary_embedding_: q and k must be [tokens, heads, head_dim], heads dense");
    TORCH_CHECK(x->size(0) == positions.size(0) && x->size(2) == 2 * cos.size(1),
                "rotary_embedding_: shapes of q/k, positions and the tables disagree");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding_: q and k dtypes differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous(),
              "rotary_embedding_: positions must be contiguous int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "rotary_embedding_: cos and sin must be contiguous float32 [positions, half]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding_: position ", pos[t],
                " is not in [0, ", cos.size(0), ")");
  }
  DISPATCH_FLOATING(q.scalar_type(), "rotary_embedding_", [&] {
    rotate_rows<scalar_t>(q, pos, cos, sin);
    rotate_rows<scalar_t>(k, pos, cos, sin);
  });
}

// out = round(silu(gate)) * up, rounded; gate_up = [gate | up] along the last dimension.
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up.data_ptr<T>() + r * gate_up.stride(0);
      const T* u = g + width;
      T* o = out.data_ptr<T>() + r * out.stride(0);
      int64_t i = 0;
#if defined(INFERCLOUD_VEC_LANES)
      using namespace infercloud_vec;
      for (; i + kLanes <= width; i += kLanes) {
        const vf x = vload(g + i);
        const vf silu = vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x))));
        // rounded to T, as torch's silu hands it to the product
        vstore(o + i, vmul(vround<T>(silu), vload(u + i)));
      }
#endif
      for (; i < width; ++i) {
        const float x = load(g[i]);
        const float silu = round_to<T>(x / (1.0f + std::exp(-x)));
        o[i] = store<T>(silu * load(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: width must be even");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  DISPATCH_FLOATING(gate_up.scalar_type(), "silu_and_mul",
                    [&] { silu_mul_rows<scalar_t>(gate_up, out); });
  return out;
}

// The float32 lanes of this build's vector paths (vec_math.h): 16 with AVX-512, 8 with AVX2
// (and FMA, F16C), 0 where the kernels run their scalar loops.
int64_t vector_lanes() {
#if defined(INFERCLOUD_VEC_LANES)
  return INFERCLOUD_VEC_LANES;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infercloud, m) {
  m.def("vector_lanes() -> int", &vector_lanes);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "rotary_embedding_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) "
      "-> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(infercloud, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
}
