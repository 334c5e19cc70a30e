// The arithmetic of every kernel, written once for both back ends.
//
// Each op is a small fp32 functor. The CPU back end (csrc/cpu) calls it inside
// `#pragma omp simd` loops over fp32 blocks; the CUDA back end (csrc/cuda)
// calls it from multi_tensor_apply. Same expression, same operand order and no
// FMA contraction (-ffp-contract=off, --fmad=false): the same bits on both.
//
// Storage types are each back end's own (cpu::F16 / cpu::BF16 on the host,
// __half / __nv_bfloat16 on the device): each names them in a Storage traits
// struct and dispatches dtypes with dispatch_float<Storage>. Internal to the
// back ends; the interface is ashl/kernels.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "ashl/kernels.h"

#ifdef __CUDACC__
#define ASHL_HD __host__ __device__ __forceinline__
#else
#define ASHL_HD inline
#endif

namespace ashl {
namespace ops {

// pack_delta: out = scale * (p - a)
struct Delta {
  float scale;
  ASHL_HD float operator()(float p, float a) const { return scale * (p - a); }
};

// pack_delta with residuals (error feedback): out = scale * (p - a) + r
struct DeltaResidual {
  float scale;
  ASHL_HD float operator()(float p, float a, float r) const { return Delta{scale}(p, a) + r; }
};

// unpack_assign: params = anchors = flat
struct Assign {
  ASHL_HD float operator()(float f) const { return f; }
};

// unpack_add: params = anchors = anchors + flat
struct Add {
  ASHL_HD float operator()(float a, float f) const { return a + f; }
};

// merge_dense, merge_sparse and each weighted_sum input after the first:
// acc + w * x. A weighted sum starts from term(x[0]), not 0 + term(x[0]),
// which would turn a -0 sum into +0.
struct AddScaled {
  float w;
  ASHL_HD float term(float x) const { return w * x; }
  ASHL_HD float operator()(float acc, float x) const { return acc + term(x); }
};

// weighted_sum of K <= 4 inputs in one pass: w[0]*x[0] + w[1]*x[1] + ...,
// summed left to right exactly as AddScaled one input at a time.
template <int K>
struct WeightedSum {
  float w[K];
  template <class... X>
  ASHL_HD float operator()(float x0, X... xs) const {
    static_assert(sizeof...(X) + 1 == K, "one input per weight");
    float a = AddScaled{w[0]}.term(x0);
    int i = 1;
    ((a = AddScaled{w[i++]}(a, xs)), ...);
    return a;
  }
};

// merge_dense's and merge_sparse's guard: NaN or +-Inf, i.e. all exponent
// bits set. A bit test is immune to fast-math flags.
ASHL_HD bool nonfinite(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return (u & 0x7f800000u) == 0x7f800000u;
}

}  // namespace ops

// ---- dtype dispatch, one convention for both back ends ----------------------

template <class T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) with T the storage type of float dtype d: float, or
// Storage::f16 / Storage::bf16. Throws std::invalid_argument naming `what`
// for any other dtype.
template <class Storage, class F>
void dispatch_float(DType d, const char* what, F&& f) {
  switch (d) {
    case DType::kFloat32: f(Tag<float>{}); return;
    case DType::kFloat16: f(Tag<typename Storage::f16>{}); return;
    case DType::kBFloat16: f(Tag<typename Storage::bf16>{}); return;
    default: require_float(d, what);  // throws
  }
}

// The two storage types of a two-dtype op: f(Tag<A>{}, Tag<B>{}).
template <class Storage, class F>
void dispatch_float(DType a, const char* what_a, DType b, const char* what_b, F&& f) {
  dispatch_float<Storage>(a, what_a, [&](auto ta) {
    dispatch_float<Storage>(b, what_b, [&](auto tb) { f(ta, tb); });
  });
}

// merge_sparse's index, value and dst storage types: f(Tag<I>{}, Tag<V>{},
// Tag<D>{}) with I int32_t or int64_t.
template <class Storage, class F>
void dispatch_sparse(DType index, DType values, DType dst, F&& f) {
  auto with_index = [&](auto ti) {
    dispatch_float<Storage>(values, "values", dst, "dst", [&](auto tv, auto td) { f(ti, tv, td); });
  };
  if (index == DType::kInt32) with_index(Tag<int32_t>{});
  else if (index == DType::kInt64) with_index(Tag<int64_t>{});
  else require_index(index, "indices");  // throws
}

}  // namespace ashl
