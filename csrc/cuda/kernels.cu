// CUDA back end: each op is a small functor run by multi_tensor_apply (one
// launch for many tensors). Storage is fp32/fp16/bf16, arithmetic is fp32.
#include <string>

#include "ashl/kernels.h"
#include "multi_tensor_apply.cuh"

namespace ashl::cuda {
namespace {

using namespace detail;

// ---- validation and dispatch (same messages as the CPU back end) -----------

int32_t* require_scratch(const CudaContext& ctx, const char* what) {
  if (ctx.scratch == nullptr)
    throw std::invalid_argument(std::string(what) + ": CudaContext.scratch is null");
  return ctx.scratch;
}

int64_t total(const std::vector<int64_t>& numels) {
  int64_t n = 0;
  for (int64_t x : numels) n += x;
  return n;
}

cudaStream_t stream_of(const CudaContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

template <class T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) with T the device storage type of a float dtype.
template <class F>
void dispatch_float(DType d, const char* what, F&& f) {
  switch (d) {
    case DType::kFloat32: f(Tag<float>{}); return;
    case DType::kFloat16: f(Tag<__half>{}); return;
    case DType::kBFloat16: f(Tag<__nv_bfloat16>{}); return;
    default: require_float(d, what);  // throws
  }
}

// ---- dense ops ----------------------------------------------------------------
// Roles are listed per op; ptrs[r] points at tensor element 0 of role r.

// 0 out (flat), 1 params, 2 anchors, 3 residuals (kRes only)
template <typename P, typename F, bool kRes>
struct PackOp {
  static constexpr int kVec = vec_for<P, F>();
  float scale;
  ASHL_HD bool skip() const { return false; }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float p[V], a[V], o[V];
    load<V>(p, static_cast<const P*>(ptrs[1]) + i);
    load<V>(a, static_cast<const P*>(ptrs[2]) + i);
    ASHL_UNROLL
    for (int j = 0; j < V; ++j) o[j] = scale * (p[j] - a[j]);
    if constexpr (kRes) {
      float r[V];
      load<V>(r, static_cast<const P*>(ptrs[3]) + i);
      ASHL_UNROLL
      for (int j = 0; j < V; ++j) o[j] += r[j];
    }
    store<V>(static_cast<F*>(ptrs[0]) + i, o);
  }
};

// 0 flat, 1 params, 2 anchors. kAdd: anchors += flat, else anchors = flat;
// then params = anchors (the same rounded value, so the bits match).
template <typename P, typename F, bool kAdd>
struct UnpackOp {
  static constexpr int kVec = vec_for<P, F>();
  ASHL_HD bool skip() const { return false; }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float v[V];
    load<V>(v, static_cast<const F*>(ptrs[0]) + i);
    if constexpr (kAdd) {
      float a[V];
      load<V>(a, static_cast<const P*>(ptrs[2]) + i);
      ASHL_UNROLL
      for (int j = 0; j < V; ++j) v[j] += a[j];
    }
    store<V>(static_cast<P*>(ptrs[2]) + i, v);
    store<V>(static_cast<P*>(ptrs[1]) + i, v);
  }
};

// 0 delta. Raises *flag on any NaN/Inf; blocks starting after it is raised skip.
template <typename X>
struct FiniteCheckOp {
  static constexpr int kVec = vec_for<X, X>();
  int32_t* flag;
  ASHL_HD bool skip() const { return flag_set(flag); }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float x[V];
    load<V>(x, static_cast<const X*>(ptrs[0]) + i);
    bool bad = false;
    ASHL_UNROLL
    for (int j = 0; j < V; ++j) bad |= nonfinite(x[j]);
    if (bad) *static_cast<volatile int32_t*>(flag) = 1;  // benign race: all write 1
  }
};

// 0 dst, 1 delta. Does nothing when the check kernel raised *flag.
template <typename D, typename X>
struct MergeOp {
  static constexpr int kVec = vec_for<D, X>();
  float weight;
  const int32_t* flag;
  ASHL_HD bool skip() const { return flag_set(flag); }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float d[V], x[V];
    load<V>(d, static_cast<const D*>(ptrs[0]) + i);
    load<V>(x, static_cast<const X*>(ptrs[1]) + i);
    ASHL_UNROLL
    for (int j = 0; j < V; ++j) d[j] += weight * x[j];
    store<V>(static_cast<D*>(ptrs[0]) + i, d);
  }
};

// Inputs per weighted_sum launch; more are handled in further passes.
constexpr int kMaxInputs = 8;

// 0 out, 1..kMaxInputs inputs (the first `count` are set).
// out = (accumulate ? out : 0) + sum_k w[k] * in_k
template <typename O, typename I>
struct WeightedSumOp {
  static constexpr int kVec = vec_for<O, I>();
  float w[kMaxInputs];
  int count;
  int accumulate;
  ASHL_HD bool skip() const { return false; }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float acc[V];
    if (accumulate) {
      load<V>(acc, static_cast<const O*>(ptrs[0]) + i);
    } else {
      ASHL_UNROLL
      for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    }
    ASHL_UNROLL
    for (int k = 0; k < kMaxInputs; ++k) {
      if (k < count) {
        float x[V];
        load<V>(x, static_cast<const I*>(ptrs[1 + k]) + i);
        ASHL_UNROLL
        for (int j = 0; j < V; ++j) acc[j] += w[k] * x[j];
      }
    }
    store<V>(static_cast<O*>(ptrs[0]) + i, acc);
  }
};

// ---- sparse merge -----------------------------------------------------------

constexpr int kSparseThreads = 256;
constexpr int64_t kSparseMaxBlocks = 8192;

// flags[0]: a value is NaN/Inf. flags[1]: INT32_MAX - (first bad position),
// 0 if none; atomicMax on it keeps the smallest position (clamped to
// INT32_MAX - 1), and zeroing initialises it.
template <typename I, typename V>
struct SparseCheck {
  const I* idx;
  const V* val;
  int64_t nnz, n;
  int32_t* flags;
  ASHL_HD void operator()(int block, int thread, int blocks, int threads) const {
    const int64_t stride = static_cast<int64_t>(blocks) * threads;
    for (int64_t k = static_cast<int64_t>(block) * threads + thread; k < nnz; k += stride) {
      const int64_t i = static_cast<int64_t>(idx[k]);
      if (i < 0 || i >= n) {
        const int64_t pos = k < INT32_MAX - 1 ? k : INT32_MAX - 1;
        atomic_max_i32(&flags[1], static_cast<int32_t>(INT32_MAX - pos));
      }
      if (nonfinite(to_f(val[k]))) *static_cast<volatile int32_t*>(&flags[0]) = 1;
    }
  }
};

ASHL_HD unsigned short to_bits(__half x) { return __half_as_ushort(x); }
ASHL_HD unsigned short to_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
ASHL_HD void from_bits(__half* x, unsigned short b) { *x = __ushort_as_half(b); }
ASHL_HD void from_bits(__nv_bfloat16* x, unsigned short b) { *x = __ushort_as_bfloat16(b); }

// *addr += v for a 16-bit float by a CAS loop, so the add is done in fp32 and
// rounded once, as on the CPU (native half/bf16 atomicAdd would round v to
// 16 bits first, and could overflow on it).
template <typename T>
ASHL_HD void atomic_add_16(T* addr, float v) {
  unsigned short* word = reinterpret_cast<unsigned short*>(addr);
  unsigned short old = *word, assumed;
  do {
    assumed = old;
    T cur;
    from_bits(&cur, assumed);
    old = atomic_cas_u16(word, assumed, to_bits(from_f<T>(to_f(cur) + v)));
  } while (old != assumed);  // integer compare: terminates even on NaN
}

ASHL_HD void atomic_add_f(float* addr, float v) { atomic_add_f32(addr, v); }
ASHL_HD void atomic_add_f(__half* addr, float v) { atomic_add_16(addr, v); }
ASHL_HD void atomic_add_f(__nv_bfloat16* addr, float v) { atomic_add_16(addr, v); }

// Scatter-add; does nothing if the check kernel raised either flag.
template <typename I, typename V, typename D>
struct SparseScatter {
  D* dst;
  const I* idx;
  const V* val;
  int64_t nnz;
  float weight;
  const int32_t* flags;
  ASHL_HD void operator()(int block, int thread, int blocks, int threads) const {
    if (flag_set(&flags[0]) || flag_set(&flags[1])) return;
    const int64_t stride = static_cast<int64_t>(blocks) * threads;
    for (int64_t k = static_cast<int64_t>(block) * threads + thread; k < nnz; k += stride)
      atomic_add_f(dst + static_cast<int64_t>(idx[k]), weight * to_f(val[k]));
  }
};

template <typename I>
bool merge_sparse_typed(Flat dst, const I* idx, const void* values, DType value_dtype,
                        int64_t nnz, float weight, int32_t* flags, cudaStream_t s) {
  const int blocks = static_cast<int>(
      std::min<int64_t>((nnz + kSparseThreads - 1) / kSparseThreads, kSparseMaxBlocks));
  zero_async(flags, 2 * sizeof(int32_t), s);
  dispatch_float(value_dtype, "values", [&](auto vt) {
    using V = typename decltype(vt)::type;
    const V* val = static_cast<const V*>(values);
    launch(blocks, kSparseThreads, s, SparseCheck<I, V>{idx, val, nnz, dst.numel, flags},
           "merge_sparse check");
    dispatch_float(dst.dtype, "dst", [&](auto dt) {
      using D = typename decltype(dt)::type;
      launch(blocks, kSparseThreads, s,
             SparseScatter<I, V, D>{static_cast<D*>(dst.data), idx, val, nnz, weight, flags},
             "merge_sparse scatter");
    });
  });
  int32_t h[2] = {0, 0};
  read_back(h, flags, sizeof(h), s);
  if (h[1] != 0) {
    const int64_t pos = INT32_MAX - static_cast<int64_t>(h[1]);
    I bad = 0;
    read_back(&bad, idx + pos, sizeof(I), s);
    // pos == INT32_MAX - 1 may be a clamped later position: then say so.
    const bool clamped = pos == INT32_MAX - 1 && nnz > INT32_MAX - 1;
    throw std::out_of_range("indices[" + std::to_string(pos) + (clamped ? " or later" : "") +
                            "] = " + std::to_string(static_cast<int64_t>(bad)) +
                            " is out of range for a buffer of " + std::to_string(dst.numel) +
                            " elements");
  }
  return h[0] == 0;
}

}  // namespace

// ---- public API -------------------------------------------------------------

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // don't leave the error for the next caller to find
    return false;
  }
  return n > 0;
}

void pack_delta(const TensorList& params, const TensorList& anchors, const TensorList* residuals,
                const std::vector<int64_t>& offsets, Flat out, float scale, CudaContext ctx) {
  check_pack_delta(params, anchors, residuals, offsets, out, scale);
  if (total(params.numels) == 0) return;
  // Roles: 0 out, 1 params, 2 anchors, 3 residuals. Without residuals three
  // roles, so more tensors fit in one launch.
  auto work = [&](auto& w) {
    w.set(0, out, offsets);
    w.set(1, params);
    w.set(2, anchors);
  };
  dispatch_float(params.dtype, "params", [&](auto pt) {
    using P = typename decltype(pt)::type;
    dispatch_float(out.dtype, "out", [&](auto ft) {
      using F = typename decltype(ft)::type;
      if (residuals) {
        Work<4> w(params.numels);
        work(w);
        w.set(3, *residuals);
        multi_tensor_apply(w, PackOp<P, F, true>{scale}, stream_of(ctx), "pack_delta");
      } else {
        Work<3> w(params.numels);
        work(w);
        multi_tensor_apply(w, PackOp<P, F, false>{scale}, stream_of(ctx), "pack_delta");
      }
    });
  });
}

namespace {
template <bool kAdd>
void unpack(const TensorList& params, const TensorList& anchors,
            const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx, const char* what) {
  check_unpack(params, anchors, offsets, flat);
  Work<3> w(params.numels);
  w.set(0, flat, offsets);
  w.set(1, params);
  w.set(2, anchors);
  if (w.total() == 0) return;
  dispatch_float(params.dtype, "params", [&](auto pt) {
    using P = typename decltype(pt)::type;
    dispatch_float(flat.dtype, "flat", [&](auto ft) {
      using F = typename decltype(ft)::type;
      multi_tensor_apply(w, UnpackOp<P, F, kAdd>{}, stream_of(ctx), what);
    });
  });
}
}  // namespace

void unpack_assign(const TensorList& params, const TensorList& anchors,
                   const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx) {
  unpack<false>(params, anchors, offsets, flat, ctx, "unpack_assign");
}

void unpack_add(const TensorList& params, const TensorList& anchors,
                const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx) {
  unpack<true>(params, anchors, offsets, flat, ctx, "unpack_add");
}

bool merge_dense(const TensorList& dst, const TensorList& delta, float weight, CudaContext ctx) {
  check_same_shape(dst, delta, "dst", "delta");
  require_finite_weight(weight, "weight");
  require_float(dst.dtype, "dst");
  require_float(delta.dtype, "delta");
  Work<2> w(dst.numels);
  w.set(0, dst);
  w.set(1, delta);
  if (w.total() == 0) return true;
  int32_t* flag = require_scratch(ctx, "merge_dense");
  const cudaStream_t s = stream_of(ctx);
  // Check everything before writing anything; the merge kernel reads the flag
  // on the device, so there is one host sync, at the end.
  zero_async(flag, sizeof(int32_t), s);
  dispatch_float(delta.dtype, "delta", [&](auto xt) {
    using X = typename decltype(xt)::type;
    Work<1> wc(delta.numels);
    wc.set(0, delta);
    multi_tensor_apply(wc, FiniteCheckOp<X>{flag}, s, "merge_dense check");
    dispatch_float(dst.dtype, "dst", [&](auto dt) {
      using D = typename decltype(dt)::type;
      multi_tensor_apply(w, MergeOp<D, X>{weight, flag}, s, "merge_dense");
    });
  });
  int32_t h = 0;
  read_back(&h, flag, sizeof(h), s);
  return h == 0;
}

bool merge_sparse(Flat dst, const void* indices, DType index_dtype, const void* values,
                  DType value_dtype, int64_t nnz, float weight, CudaContext ctx) {
  if (nnz < 0) throw std::invalid_argument("nnz is negative");
  if (nnz > 0 && (indices == nullptr || values == nullptr))
    throw std::invalid_argument("indices/values: null pointer");
  if (dst.numel < 0) throw std::invalid_argument("dst: negative size");
  if (dst.numel > 0 && dst.data == nullptr) throw std::invalid_argument("dst: null pointer");
  require_finite_weight(weight, "weight");
  require_float(value_dtype, "values");
  require_float(dst.dtype, "dst");
  if (index_dtype != DType::kInt32 && index_dtype != DType::kInt64)
    throw std::invalid_argument(std::string("indices: unsupported dtype ") +
                                dtype_name(index_dtype) + " (expected int32 or int64)");
  if (nnz == 0) return true;
  int32_t* flags = require_scratch(ctx, "merge_sparse");
  const cudaStream_t s = stream_of(ctx);
  if (index_dtype == DType::kInt32)
    return merge_sparse_typed(dst, static_cast<const int32_t*>(indices), values, value_dtype, nnz,
                              weight, flags, s);
  return merge_sparse_typed(dst, static_cast<const int64_t*>(indices), values, value_dtype, nnz,
                            weight, flags, s);
}

void weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                  const std::vector<float>& weights, CudaContext ctx) {
  check_weighted_sum(out, inputs, weights);
  check_same_shape(out, out, "out", "out");
  require_float(out.dtype, "out");
  const size_t K = inputs.size();
  const DType in_dtype = K ? inputs[0].dtype : out.dtype;  // no inputs: out = 0
  require_float(in_dtype, "inputs");
  // Passes after the first read `out` back as their accumulator, so `out`
  // must not be one of the inputs they read (it was overwritten by then).
  for (size_t k = kMaxInputs; k < K; ++k)
    for (size_t i = 0; i < out.ptrs.size(); ++i)
      if (out.numels[i] > 0 && inputs[k].ptrs[i] == out.ptrs[i])
        throw std::invalid_argument("weighted_sum: out aliases inputs[" + std::to_string(k) +
                                    "]; with more than " + std::to_string(kMaxInputs) +
                                    " inputs out may only alias one of the first " +
                                    std::to_string(kMaxInputs));
  if (total(out.numels) == 0) return;
  dispatch_float(out.dtype, "out", [&](auto ot) {
    using O = typename decltype(ot)::type;
    dispatch_float(in_dtype, "inputs", [&](auto it) {
      using I = typename decltype(it)::type;
      // Do-while: K == 0 still runs one pass, which writes zeros.
      size_t k0 = 0;
      do {
        const size_t k1 = std::min(K, k0 + kMaxInputs);
        Work<1 + kMaxInputs> w(out.numels);
        w.set(0, out);
        WeightedSumOp<O, I> op{};
        for (size_t k = k0; k < k1; ++k) {
          w.set(static_cast<int>(1 + k - k0), inputs[k]);
          op.w[k - k0] = weights[k];
        }
        op.count = static_cast<int>(k1 - k0);
        op.accumulate = k0 > 0;
        multi_tensor_apply(w, op, stream_of(ctx), "weighted_sum");
        k0 = k1;
      } while (k0 < K);
    });
  });
}

}  // namespace ashl::cuda
